"""One engine's lease table: its leases and every decision about them (no vLLM import).

``LeaseTable`` holds, for each user with demand on this engine, its lease
(``lease.Lease``: this engine's share of the user's limit, when it expires,
when to ask again, what it reports), the users waiting for a usable lease
(*blocked*), the limits in force, and whether the engine serves without the
store. It decides what a round asks (``asks``), and applies a round's answer
(``answered`` then ``apply_answer``), a failed round (``round_failed``: wait,
then the fallback share) and a change of limits (``set_limits``); each of
these returns the pacer's rate changes (user -> tok/s, None: the default
rate) and leaves pacing to its caller.

It is pure: no thread, no lock, no clock (every time is passed in as
``now``), no store. ``leases.LeasedLimiter`` calls its decisions from the
scheduler and refresher threads under its lock; the pacing calls
(``lease_pacing.py``) read the blocked users and leases, and write a
lease's use, from the scheduler thread without it, looking each lease up
again since a round may have dropped it meanwhile. Why the asks, shares
and fallbacks are what they are, and the global bound they keep:
docs/architecture.md, "The shared store".
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.store.lease import NS, Lease
from vllm_output_rate.store.messages import UNBOUNDED, Exchange, LeaseAsk, Round
from vllm_output_rate.store.resume import ResumeCaps
from vllm_output_rate.store.settings import StoreSettings

# The pacer's rate changes: user -> tok/s (None: back to the default rate).
RateChanges = dict[str, float | None]


@dataclass
class StoreCounters:
    """Lease and store state for metrics (see integration/metrics.py)."""

    exchanges: int = 0
    asks: int = 0  # users sent in successful exchanges
    failures: int = 0
    fallbacks: int = 0  # times the engine started serving without the store
    grants: int = 0  # leases granted or raised
    returns: int = 0  # leases lowered or given back
    rtt_sum_s: float = 0.0
    rtt_max_s: float = 0.0
    # Seconds from a failed round to the next answer (or to the fallback):
    # the time shared and new users were held back for want of the store.
    failing_s: float = 0.0
    last_error: str = ""


class Outage(enum.Enum):
    """What a failed round began (``round_failed``), for the caller to log."""

    FAILING = "failing"  # rounds fail: new and shared users wait
    DEGRADED = "degraded"  # no answer for a lease period: fallback shares


@dataclass
class Answer:
    """What applying a round's answer changed (``apply_answer``)."""

    rates: RateChanges
    resumed: bool  # the engine was serving without the store until now
    waiting: set[str] = field(default_factory=set)  # users still without a lease


class LeaseTable:
    """The leases of one engine and the limits they are shares of."""

    def __init__(
        self,
        settings: StoreSettings,
        default_rate: float,
        user_rates: dict[str, float],
        *,
        engines_hint: int,
        now_ns: int,
        lend_unused: bool = True,
    ) -> None:
        self.settings = settings
        # Whether a shared user's share this engine leaves unused goes to
        # the engines that need it (each ask reports what it used). For a
        # steady use (output tokens); bursts (prompt tokens) would wait a
        # grace period for their share back, so they keep it.
        self.lend_unused = lend_unused
        self.default_rate = default_rate
        self.user_rates = user_rates
        self.limits_version = 0
        self.lease_ns = round(settings.lease_s * NS)
        self.refresh_ns = round(settings.refresh_s * NS)
        self.leases: dict[str, Lease] = {}
        self._renewals: list[tuple[int, int, str]] = []  # heap: due, seq, user
        self._seq = itertools.count()
        self._renew_all = False
        self.shared: set[str] = set()
        # Users with demand and no usable rate; the subset still waiting
        # for their first answer.
        self.blocked: set[str] = set()
        self.awaiting: set[str] = set()
        self.demand: Mapping[str, int] = {}
        self.degraded = False  # serving without the store
        self.resume_caps = ResumeCaps()  # after it, for a lease period
        # Sent time of the last round the store answered (at first: our
        # start). Rounds fail for a moment on a loaded machine; only after a
        # whole lease period without an answer does the engine fall back.
        self._answered_ns = now_ns
        self._failing = False  # rounds are failing, not yet degraded
        self._failing_since_ns = 0
        self.engines_seen = max(1, engines_hint)
        self.counters = StoreCounters()
        self._started = False

    def rate_of(self, user: str) -> float:
        return self.user_rates.get(user, self.default_rate)

    def fallback_rate(self, user: str) -> float:
        share = self.settings.fallback_share or 1.0 / self.engines_seen
        return self.rate_of(user) * share

    def lease_rate(self, user: str) -> float | None:
        lease = self.leases.get(user)
        return None if lease is None else lease.rate

    def failing_seconds(self, now: int) -> float:
        ongoing = now - self._failing_since_ns if self._failing else 0
        return self.counters.failing_s + ongoing / NS

    def snapshot(self, now: int) -> dict[str, Any]:
        """The table's state and counters, for operators and metrics."""
        counters = self.counters
        return {
            "degraded": self.degraded,
            "engines_seen": self.engines_seen,
            "leases": len(self.leases),
            "shared_users": len(self.shared),
            "blocked_users": len(self.blocked),
            "exchanges": counters.exchanges,
            "asks": counters.asks,
            "failures": counters.failures,
            "fallbacks": counters.fallbacks,
            "grants": counters.grants,
            "returns": counters.returns,
            "rtt_sum_s": counters.rtt_sum_s,
            "rtt_max_s": counters.rtt_max_s,
            "failing_s": self.failing_seconds(now),
            "limits_version": self.limits_version,
        }

    # ----- a round's asks ------------------------------------------------

    def asks(self, demand: Mapping[str, int], now: int) -> list[LeaseAsk]:
        """What to send now: new users, renewals due, users that left."""
        leases = self.leases
        asks: dict[str, LeaseAsk] = {}
        for user in demand.keys() - leases.keys():
            asks[user] = LeaseAsk(user, demand[user], self._want_cap(user, now))
        due: Iterable[str]
        if self._renew_all or self.degraded:
            self._renew_all = False
            due = list(leases)
            self._renewals.clear()
        else:
            due = self._pop_due(now)
        for user in due:
            lease = leases.get(user)
            if lease is None or user in asks:
                continue
            weight = lease.report_weight(demand.get(user, 0))
            if weight is None:
                self._schedule(user, lease, self.refresh_ns, now)
                continue  # idle for a moment: ask nothing, keep the share
            want = lease.report_want(now, weight) if self.lend_unused else UNBOUNDED
            cap = self._want_cap(user, now)
            if cap != UNBOUNDED and (want == UNBOUNDED or want > cap):
                want = cap
            asks[user] = LeaseAsk(user, weight, want)
            lease.weight = weight
            if weight == 0:
                # Given back: not used from now on (the user has no demand).
                del leases[user]
                self.shared.discard(user)
        return list(asks.values())

    def _want_cap(self, user: str, now: int) -> float:
        """The most ``user`` may use of a lease now: its fallback share while
        this engine serves without the store or holds it to that share after
        the store came back (``resume.py``); then it asks for no more, and the
        store leaves the rest to the other engines at once."""
        if self.degraded:
            return self.fallback_rate(user)
        cap = self.resume_caps.cap(user, now)
        return UNBOUNDED if cap is None else cap

    def _pop_due(self, now: int) -> list[str]:
        heap, due = self._renewals, []
        while heap and heap[0][0] <= now:
            renew_ns, _, user = heapq.heappop(heap)
            lease = self.leases.get(user)
            if lease is not None and lease.renew_ns == renew_ns:
                due.append(user)
        return due

    def _schedule(self, user: str, lease: Lease, delay_ns: int, now: int) -> None:
        lease.renew_ns = now + delay_ns
        heapq.heappush(self._renewals, (lease.renew_ns, next(self._seq), user))

    # ----- demand, between steps ------------------------------------------

    def note_peaks(self, demand: Mapping[str, int]) -> None:
        """Keep each shared user's peak demand since its last ask."""
        leases = self.leases
        for user in self.shared:
            lease = leases.get(user)
            if lease is not None:
                lease.peak_demand = max(lease.peak_demand, demand.get(user, 0))

    def note_demand(self, demand: Mapping[str, int]) -> set[str]:
        """Take the engine's demand; return the users new to it (blocked
        until their first answer, unless the engine serves without store)."""
        self.demand = demand
        new = demand.keys() - self.leases.keys() - self.awaiting
        if new and not self.degraded:
            self.blocked |= new
            self.awaiting |= new
        return new

    # ----- a round's outcome ----------------------------------------------

    def answered(self, sent_ns: int, now: int) -> None:
        """The store answered the round sent at ``sent_ns``."""
        self._answered_ns = max(self._answered_ns, sent_ns)
        self._stop_failing(now)

    def apply_answer(self, round_: Round, exchange: Exchange, now: int) -> Answer:
        """The leases the store granted in answer to ``round_``."""
        resumed = self.degraded
        if resumed:
            self.degraded = False
            # Every user with demand was served at its fallback share (no
            # lease outlives a lease period without answers); the shares
            # are the ones served, from the engines seen before the outage.
            served = {user: self.fallback_rate(user) for user in self.demand}
            self.resume_caps.begin(served, now + self.lease_ns)
        elif exchange.fresh and self._started:
            self._renew_all = True  # the store forgot us: it restarted
        self.engines_seen = max(1, exchange.engines)
        self._started = True
        rates: RateChanges = {}
        self._apply_rates(exchange, round_, now, rates)
        # Users that came while serving without the store (or after this
        # round was sent) wait for their lease like any new user.
        waiting = self.demand.keys() - self.leases.keys()
        self.blocked |= waiting
        self.awaiting |= waiting
        return Answer(rates, resumed, waiting)

    def _apply_rates(
        self, exchange: Exchange, round_: Round, now: int, rates: RateChanges
    ) -> None:
        leases, counters = self.leases, self.counters
        released = {ask.user for ask in round_.asks if ask.weight == 0}
        for user, rate in exchange.rates.items():
            if user in released:
                rates[user] = None
                continue
            lease = leases.get(user)
            if lease is None:
                if user not in self.awaiting and user not in self.demand:
                    continue  # an answer for a user that already left
                lease = leases[user] = Lease(
                    rate=0.0, expires_ns=0, weight=0, renew_ns=0
                )
                lease.reported_ns = now
            if rate > lease.rate:
                counters.grants += 1
            elif rate < lease.rate:
                counters.returns += 1
            lease.rate = rate
            lease.expires_ns = round_.sent_ns + self.lease_ns
            lease.shared = user in exchange.shared
            self.awaiting.discard(user)
            if lease.shared:
                self.shared.add(user)
            else:
                self.shared.discard(user)
            if rate > 0:
                self.blocked.discard(user)
                usable = self.resume_caps.usable(user, rate, now)
                rates[user] = None if usable == self.default_rate else usable
            else:
                self.blocked.add(user)
            # Shared, starved or held users are asked about every cycle.
            held = self.resume_caps.holds(user, now)
            contended = lease.shared or rate <= 0 or held
            self._schedule(
                user, lease, self.refresh_ns if contended else self.lease_ns // 2, now
            )
        counters.returns += len(released)

    def round_failed(self, sent_ns: int, now: int) -> tuple[RateChanges, Outage | None]:
        """A failed round, sent at ``sent_ns``. Within one lease period of
        the last answer (a blip) shared users and users without a usable
        lease wait, unshared leases hold until they expire, and the next
        round renews every lease; after it, every user gets its fallback
        share (docs/architecture.md, "When the store fails"). Returns the
        rate changes and the outage this round began, if any."""
        rates: RateChanges = {}
        began: Outage | None = None
        # Judged by when the failed round was sent, not by now: an idle
        # engine applies its rounds only at its next step, and a blip while
        # it was idle is no reason to fall back when traffic returns.
        silent_ns = sent_ns - self._answered_ns
        if not self.degraded and silent_ns < self.lease_ns:
            if not self._failing:
                self._failing = True
                self._failing_since_ns = now
                began = Outage.FAILING
            self._renew_all = True
            for user, lease in self.leases.items():
                if lease.shared or lease.expires_ns <= now:
                    self.blocked.add(user)
            return rates, began
        if not self.degraded:
            self._stop_failing(now)
            self.degraded = True
            self.counters.fallbacks += 1
            began = Outage.DEGRADED
        for user in self.blocked:
            rates[user] = self.fallback_rate(user)
        self.blocked.clear()
        self.awaiting.clear()
        for user, lease in list(self.leases.items()):
            if lease.expires_ns <= now:
                rates[user] = self.fallback_rate(user)
                del self.leases[user]
                self.shared.discard(user)
        for user in self.demand.keys() - self.leases.keys():
            rates.setdefault(user, self.fallback_rate(user))
        return rates, began

    def _stop_failing(self, now: int) -> None:
        if self._failing:
            self._failing = False
            self.counters.failing_s += (now - self._failing_since_ns) / NS

    # ----- limits ----------------------------------------------------------

    def set_limits(
        self, default: float, overrides: dict[str, float], now: int
    ) -> RateChanges:
        """New configured limits: lowered limits lower leases at once."""
        old_default, old_overrides = self.default_rate, self.user_rates
        self.default_rate, self.user_rates = default, overrides
        changed = {
            user
            for user in old_overrides.keys() | overrides.keys()
            if old_overrides.get(user, old_default) != overrides.get(user, default)
        }
        if default != old_default:
            changed |= self.leases.keys()
        rates: RateChanges = {}
        for user in changed:
            lease = self.leases.get(user)
            old = old_overrides.get(user, old_default)
            new = overrides.get(user, default)
            if lease is not None:
                if new < old and lease.rate > 0:
                    lease.rate = round(lease.rate * new / old, 3) or 0.001
                self._schedule(user, lease, 0, now)
                if lease.rate > 0 and not self.degraded:
                    usable = self.resume_caps.usable(user, lease.rate, now)
                    rates[user] = None if usable == default else usable
            if self.degraded and (lease is None or lease.expires_ns <= now):
                rates[user] = self.fallback_rate(user)
        return rates
