"""One engine's leases of shared limits, spent with local GCRA pacing (no vLLM import).

``LeasedLimiter`` is the policy's budget (``budget.Budget``) when a shared
store is configured: the same calls as ``OutputRateLimiter``, with each user
paced locally by an ``OutputRateLimiter`` (the *pacer*) at this engine's
lease of its limit, so the scheduler never waits on the network. A user with
demand and no usable lease yet is *blocked* (granted nothing) until its
first answer, which the refresher fetches at once.

Two threads share it. The scheduler thread alone touches the pacer; it calls
the budget, ``attach``, ``between_steps`` (start of every step: apply the
posted results, note new users) and ``apply_pending``. The refresher thread
(``refresher.py``) calls ``start_round`` and ``finish_round``, which build
its asks and post its results under ``_lock``. The leases and every decision
about them are in ``lease_table.LeaseTable`` (pure), the budget's calls at
the pacer in ``lease_pacing.LeasePacing`` (which this class extends); this
class is the lock and the hand-off between the threads.

The bound this keeps over all engines (at most ``(W + b) x limit + N`` tokens
of a user in any window of W seconds, N engines holding a lease), its proof
and what lies outside it: docs/architecture.md, "The shared store".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vllm_output_rate.limiter import DEFAULT_BURST_NS, OutputRateLimiter
from vllm_output_rate.store.lease_pacing import LeasePacing
from vllm_output_rate.store.lease_table import (
    LeaseTable,
    Outage,
    RateChanges,
    StoreCounters,
)
from vllm_output_rate.store.messages import (
    Exchange,
    LimitsWrite,
    Round,
    StoredLimits,
)
from vllm_output_rate.store.posted import Posted, post
from vllm_output_rate.store.settings import StoreSettings
from vllm_output_rate.validation import validate_rate, validate_user_name

# Slack for the engine's step between an answer's arrival and its use.
STEP_SLACK_S = 0.1


class LeasedLimiter(LeasePacing):
    """The step budget's limiter when limits are shared through a store."""

    def __init__(
        self,
        default_rate: float,
        user_rates: Mapping[str, float] | None,
        settings: StoreSettings,
        *,
        engines_hint: int = 1,
        burst_ns: int = DEFAULT_BURST_NS,
        clock: Callable[[], int] = time.monotonic_ns,
        logger: logging.Logger | None = None,
        lend_unused: bool = True,
        members: Mapping[str, str] | None = None,
    ) -> None:
        """``members``: each member's group, kept in the store beside a
        table keyed by group (a teams' budget); ``on_members`` is called
        with them (scheduler thread) when another engine changed them."""
        self.settings = settings
        self.pacer = OutputRateLimiter(default_rate, burst_ns=burst_ns, clock=clock)
        self._clock = clock
        self._logger = logger or logging.getLogger("vllm.output_rate")
        self.table = LeaseTable(
            settings,
            self.pacer.default_rate,
            {
                validate_user_name(u): validate_rate(r, f"rate of user {u!r}")
                for u, r in (user_rates or {}).items()
            },
            engines_hint=engines_hint,
            now_ns=clock(),
            lend_unused=lend_unused,
        )
        self.grace_us = round(
            (settings.timeout_s + STEP_SLACK_S) * 1e6 + burst_ns / 1000
        )
        self._lock = threading.Lock()
        self.kick = threading.Event()  # the refresher's doorbell
        self._generation: object = None
        self._has_requests: Callable[[], bool] = lambda: True
        self._results: list[Posted] = []
        self._writes: list[LimitsWrite] = []
        # Replaced whole, never changed in place (the refresher copies it).
        self.members: dict[str, str] = dict(members or {})
        self.on_members: Callable[[dict[str, str]], None] | None = None

    # ----- an operator's change (the rest of the Budget interface) ---------

    def update_rates(
        self,
        *,
        default_rate: float | None = None,
        user_rates: Mapping[str, float] | None = None,
        remove_users: Iterable[str] = (),
    ) -> None:
        """An operator's change (admin endpoint, limits file): applied here
        at once and written to the store for every other engine."""
        write = LimitsWrite(
            None
            if default_rate is None
            else validate_rate(default_rate, "default rate"),
            {
                validate_user_name(u): validate_rate(r, f"rate of user {u!r}")
                for u, r in (user_rates or {}).items()
            },
            tuple(validate_user_name(u) for u in remove_users),
        )
        overrides = dict(self.table.user_rates)
        for user in write.remove_users:
            overrides.pop(user, None)
        overrides.update(write.user_rates)
        self._apply_limits(
            self.table.default_rate
            if write.default_rate is None
            else write.default_rate,
            overrides,
        )
        with self._lock:
            self._writes.append(write)
        self.kick.set()

    def update_members(
        self, members: Mapping[str, str], remove: Iterable[str] = ()
    ) -> None:
        """An operator's change of members: applied here at once and written
        to the store for every other engine."""
        write = LimitsWrite(None, {}, (), dict(members), tuple(remove))
        changed = {
            m: g for m, g in self.members.items() if m not in write.remove_members
        }
        self.members = changed | write.members
        with self._lock:
            self._writes.append(write)
        self.kick.set()

    # ----- the scheduler thread, between steps ----------------------------

    def attach(self, has_requests: Callable[[], bool]) -> None:
        """``has_requests``: whether the engine has unfinished requests (when
        it has none it takes no steps, so the demand seen last is stale)."""
        self._has_requests = has_requests

    def between_steps(self, demand: Mapping[str, int], generation: object) -> None:
        """Apply the refresher's results; note new users (``generation``
        changes whenever a user appears or leaves ``demand``)."""
        self.apply_pending()
        table = self.table
        if table.shared:
            table.note_peaks(demand)
        if generation != self._generation or demand is not table.demand:
            with self._lock:
                self._generation = generation
                new = table.note_demand(demand)
            if new:
                if table.degraded:
                    self.pacer.set_user_rates({u: table.fallback_rate(u) for u in new})
                self.kick.set()

    def apply_pending(self) -> None:
        """Apply the refresher's posted results (scheduler thread only; also
        called by the operator channel, which runs there, so that an idle
        engine reports current limits)."""
        if self._results:
            with self._lock:
                results, self._results = self._results, []
            for posted in results:
                self._apply_result(posted)

    # ----- the refresher thread ------------------------------------------

    def start_round(self) -> Round:
        """What to send now: new users, renewals due, users that left."""
        now = self._clock()
        table = self.table
        with self._lock:
            demand = dict(table.demand) if self._has_requests() else {}
            asks = table.asks(demand, now)
            writes, self._writes = self._writes, []
            return Round(
                asks,
                now,
                table.limits_version,
                writes,
                (table.default_rate, dict(table.user_rates)),
                dict(self.members),
            )

    def finish_round(
        self,
        round_: Round,
        exchange: Exchange | None,
        limits: StoredLimits | None = None,
        error: str = "",
        round_trip_s: float = 0.0,
    ) -> None:
        """Post the round's outcome; the scheduler applies it between steps.

        ``round_trip_s``: wall-clock time of the round's store calls."""
        with self._lock:
            if exchange is None:
                self._writes[:0] = round_.writes  # retried next round
            post(
                self._results,
                Posted(round_, exchange, limits, error, round_trip_s, round_trip_s),
            )

    # ----- applying a round's outcome (scheduler thread) -------------------

    def _apply_result(self, posted: Posted) -> None:
        table, counters = self.table, self.table.counters
        round_, exchange, limits = posted.round, posted.exchange, posted.limits
        if exchange is None:
            counters.failures += posted.rounds
            counters.last_error = posted.error
            self._serve_without_store(posted.error, round_.sent_ns)
            return
        counters.exchanges += posted.rounds
        table.answered(round_.sent_ns, self._clock())
        counters.asks += len(round_.asks)
        counters.rtt_sum_s += posted.rtt_sum_s
        counters.rtt_max_s = max(counters.rtt_max_s, posted.rtt_max_s)
        # Any other version: a restarted store counts from 1 again.
        if limits is not None and limits.version != table.limits_version:
            self._adopt_stored_limits(limits)
        now = self._clock()
        with self._lock:
            answer = table.apply_answer(round_, exchange, now)
        rates = answer.rates
        if answer.resumed:
            self._logger.warning(
                "Output rate store %s reachable again: leases resumed",
                self.settings.display_url,
            )
            # Users served at their fallback share go back to leases.
            rates = dict.fromkeys(self.pacer.user_rates, None) | rates
        self._set_rates(rates)
        if answer.waiting:
            self.kick.set()

    def _serve_without_store(self, error: str, sent_ns: int) -> None:
        """A failed round: ``LeaseTable.round_failed`` says who waits, and
        when the engine falls back to serving every user at its fallback
        share."""
        with self._lock:
            rates, began = self.table.round_failed(sent_ns, self._clock())
        if began is Outage.FAILING:
            self._logger.warning(
                "Output rate store round failed (%s): retrying every "
                "%g s; users only this engine serves keep their leases "
                "until they expire, new and shared users wait, and "
                "every user falls back to its fallback share if no "
                "answer comes within %g s",
                error,
                self.settings.refresh_s,
                self.settings.lease_s,
            )
        elif began is Outage.DEGRADED:
            self._logger.warning(
                "Output rate store unreachable (%s): serving leases until they "
                "expire, then each user at %s of its limit",
                error,
                (
                    f"{self.settings.fallback_share:g}"
                    if self.settings.fallback_share
                    else f"1/{self.table.engines_seen} (engines last seen)"
                ),
            )
        self._set_rates(rates)

    def _apply_limits(self, default: float, overrides: dict[str, float]) -> None:
        """New configured limits: lowered limits lower leases at once."""
        if default != self.table.default_rate:
            self.pacer.update_rates(default_rate=default)
        now = self._clock()
        with self._lock:
            rates = self.table.set_limits(default, overrides, now)
        self._set_rates(rates)

    def _adopt_stored_limits(self, limits: StoredLimits) -> None:
        table = self.table
        if (limits.default_rate, limits.user_rates) != (
            table.default_rate,
            table.user_rates,
        ):
            self._logger.info(
                "Output rate limits from the store (version %d): default %s tok/s, "
                "%d user override(s)",
                limits.version,
                limits.default_rate,
                len(limits.user_rates),
            )
            self._apply_limits(limits.default_rate, dict(limits.user_rates))
        table.limits_version = limits.version
        if limits.members != self.members:
            self.members = dict(limits.members)
            if self.on_members is not None:
                self.on_members(self.members)

    def _set_rates(self, rates: RateChanges) -> None:
        if rates:
            self.pacer.set_user_rates(rates)

    # ----- observers -------------------------------------------------------

    @property
    def counters(self) -> StoreCounters:
        return self.table.counters

    def store_snapshot(self) -> dict[str, Any]:
        return {
            "url": self.settings.display_url,
            **self.table.snapshot(self._clock()),
        }

    def failing_seconds(self) -> float:
        """Seconds shared and new users waited on failed rounds so far,
        the current run of failures included."""
        return self.table.failing_seconds(self._clock())

    def lease_rate(self, user: str) -> float | None:
        """This engine's share of ``user``'s limit (None: no lease)."""
        return self.table.lease_rate(user)
