"""One user's lease on one engine, and what it reports at each ask (pure).

``Lease`` is this engine's share of one user's limit (its rate, expiry and
next ask) and, for a user other engines serve too (*shared*), what it used
and how often it was held back since the last ask. At each ask it reports a
weight (``report_weight``) and a want (``report_want``), and notes what it
reported; no clock (``now`` is passed in). ``lease_table.LeaseTable`` keeps
the leases; why the weights and wants are what they are:
docs/architecture.md, "How the store divides a limit".
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_output_rate.store.messages import UNBOUNDED

NS = 1_000_000_000
# A shared user's lease is given back after this many asks in a row (one
# per refresh cycle) saw no demand at all.
RELEASE_AFTER_IDLE_ASKS = 3
# An engine that was not held back reports what it used, with headroom.
WANT_HEADROOM = 1.25
WANT_EXTRA_TOK_S = 2.0


@dataclass(slots=True)
class Lease:
    rate: float  # this engine's share, tok/s (0: none free right now)
    expires_ns: int  # local clock; the rate is not used after it
    weight: float  # unfinished requests reported with the last ask
    renew_ns: int  # when the next ask is due
    shared: bool = False  # other engines hold a lease for this user too
    # For shared users: tokens taken and steps held back (monotonic), and
    # their values at the last ask.
    used: int = 0
    held_back: int = 0
    reported_used: int = 0
    reported_held_back: int = 0
    reported_ns: int = 0
    used_rate: float = 0.0  # smoothed tok/s
    # For shared users: the most unfinished requests in any step since the
    # last ask, and how many asks in a row saw none. A stream between two
    # requests has none for a moment; an instant's count would move shares,
    # and every lowered share idles for the grace.
    peak_demand: int = 0
    idle_asks: int = 0

    def report_weight(self, now_demand: int) -> int | None:
        """The weight to report: a shared user's peak demand since the last
        ask; None (ask nothing yet) while it has been idle only briefly."""
        if not self.shared:
            return now_demand
        peak, self.peak_demand = max(self.peak_demand, now_demand), 0
        if peak:
            self.idle_asks = 0
            return peak
        self.idle_asks += 1
        return None if self.idle_asks < RELEASE_AFTER_IDLE_ASKS else 0

    def report_want(self, now: int, weight: float) -> float:
        """What this engine asks for: unbounded, unless the user is shared
        and was never held back since the last ask (then: what it used)."""
        if not self.shared or weight == 0:
            return UNBOUNDED
        elapsed_s = max(1e-3, (now - self.reported_ns) / NS)
        rate = (self.used - self.reported_used) / elapsed_s
        held_back = self.held_back != self.reported_held_back
        self.reported_used, self.reported_held_back = self.used, self.held_back
        self.reported_ns = now
        self.used_rate = rate if not self.used_rate else 0.5 * (self.used_rate + rate)
        if held_back:
            return UNBOUNDED
        return round(self.used_rate * WANT_HEADROOM + WANT_EXTRA_TOK_S, 3)
