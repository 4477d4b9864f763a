"""A refresher round's outcome on its way to the scheduler thread (no vLLM import).

The refresher posts each round's outcome (``Posted``: the round, the store's
answer or the failure, the limits read, the round trip) to a list that the
scheduler thread drains between steps (``leases.LeasedLimiter``; the caller
holds its lock). ``post`` keeps that list short while the engine is idle:
rounds in a row that asked, wrote and were granted nothing become one entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_output_rate.store.messages import Exchange, Round, StoredLimits


@dataclass
class Posted:
    """One round's outcome, or several rounds in a row that carried nothing."""

    round: Round
    exchange: Exchange | None  # None: the round failed
    limits: StoredLimits | None
    error: str
    rtt_sum_s: float
    rtt_max_s: float
    rounds: int = 1

    @property
    def carries_nothing(self) -> bool:
        """Nothing but a heartbeat: no asks, writes or rates."""
        return not (
            self.round.asks
            or self.round.writes
            or (self.exchange is not None and self.exchange.rates)
        )

    def absorb(self, later: Posted) -> None:
        """Take in the next round's outcome (both carry nothing, and both
        failed or both succeeded): its time, limits and error prevail; a
        store restart seen by either is kept."""
        if self.exchange is not None and later.exchange is not None:
            fresh = self.exchange.fresh or later.exchange.fresh
            self.exchange = dataclasses.replace(later.exchange, fresh=fresh)
        self.round = later.round
        self.limits = later.limits or self.limits
        self.error = later.error or self.error
        self.rtt_sum_s += later.rtt_sum_s
        self.rtt_max_s = max(self.rtt_max_s, later.rtt_max_s)
        self.rounds += later.rounds


def post(results: list[Posted], posted: Posted) -> None:
    """Append ``posted``, or merge it into the last entry when both carry
    nothing and both failed or both succeeded. An idle engine takes no steps
    to apply its rounds, and its heartbeats (ten a second) piled up (a day
    idle: about 750 MB, and 2 s of applying at the next step)."""
    last = results[-1] if results else None
    if (
        last is not None
        and (last.exchange is None) == (posted.exchange is None)
        and last.carries_nothing
        and posted.carries_nothing
    ):
        last.absorb(posted)
    else:
        results.append(posted)
