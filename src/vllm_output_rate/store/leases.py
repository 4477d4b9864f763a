"""One engine's leases of shared limits, spent with local GCRA pacing (no vLLM import).

``LeasedLimiter`` is the limiter the scheduling policy uses when a shared
store is configured; without one it uses ``OutputRateLimiter`` directly (the
embedded, in-memory default), and both offer the same calls (``Budget`` in
``budget.py``). Here every user with demand on this engine holds a *lease*:
a share ``r`` of that user's limit, valid for ``lease_s`` seconds. Tokens
are paced locally by an ``OutputRateLimiter`` (the *pacer*) at ``r``, so the
scheduler never waits on the network; a background refresher
(``refresher.py``) renews leases before they run out, asks for new users
and gives back leases of users that left. A user whose demand is on one
engine only holds its whole limit there, at no cost per step beyond the
plain limiter's.

Threads: the scheduler thread alone touches the pacer. The refresher builds
its asks and posts its results under ``_lock``; ``between_steps`` (start of
every scheduler step) applies posted results. A user with demand and no
usable lease yet is *blocked* (granted nothing) until its first answer,
which the refresher fetches at once.

The global bound, while every engine reaches the store
-----------------------------------------------------------------------
Claim: in every window of W seconds, the tokens one user receives over all
engines are at most ``(W + b) x limit + N``, where b is the GCRA burst
(0.1 s) and N the number of engines that held a lease for the user during
the window. (One engine: the specification's ``(W + b) x limit + 1``.)

Proof. Give each token the engine admits a *slot*: the interval from its
due time ``a = max(TAT, now)`` to ``a + 1/r``, where r is the engine's rate
when admitting it. GCRA admits a token only when ``a <= now + b``, and moves
the TAT to the slot's end, so one engine's slots are disjoint, and a token
admitted at ``s`` has its slot start in ``[s, s + b]``. (A rate change keeps
the TAT's absolute time, ``set_user_rates``; a refund in the same step gives
back an undispatched token's slot.) A token counts ``r x (1/r) = 1``, so an
engine's tokens admitted in ``[t, t + W]`` are ``∫ rho_e`` over their slots,
with ``rho_e(x)`` the rate that the slot covering x was admitted at; all
these slots start within ``[t, t + W + b]`` and at most one per engine ends
after it (+1 each, the N). What remains is ``sum_e rho_e(x) <= limit`` at
every instant x. The store grants a rate only out of what is free: the
limit minus what the other engines' leases count (``redis_store.py``). A
lease counts its rate from when the store grants it (before the engine can
use it) until ``lease_s + grace + 1/r`` after, and a lowered or returned
rate keeps counting its old value for ``grace + 1/r_old``. An engine uses a
rate for ``lease_s`` after sending the ask at most, and adopts a lowered
rate at its first step after the answer arrives, within ``grace`` =
store timeout + step slack + b of the store's decision; a slot admitted at
rate r ends at most ``b + 1/r`` after admission. So ``rho_e(x)`` never
exceeds what the store counts for e at x, and the counted rates never sum
above the limit (each grant keeps them so, counted values only fall with
time). Hence ``sum_e rho_e(x) <= limit``. QED. Long run: with demand above
the limit on every engine holding a lease, the granted shares sum to the
limit (shares are rounded down to 0.001 tok/s), and each pacer delivers its
share exactly.

Outside the claim: a limit lowered by an operator holds from the first
refresh after it (within ``refresh_s``); a store that restarts forgets the
leases it gave, so for up to one refresh interval engines holding leases
from before and leases granted after can overlap (the engines renew every
lease at once when they notice); and once an engine has had no answer for a
whole lease period (``lease_s``) it serves every user at its fallback share
(``limit x fallback_share``, by default ``limit / the number of engines it
last saw``), which sums to the limit when every engine falls back together.
Failed rounds before that stay inside the claim: the engine serves only
unshared leases until they expire and holds back everyone else until the
store answers (``_serve_without_store``). One narrow case is not covered: a
user that becomes shared at the store during the very round whose answer is
lost keeps its unshared lease here until the next answer or its expiry.

Over 400 lines: the proof above, and one class whose two halves (the
scheduler's calls, the refresher's rounds) share one lock-guarded state;
the store's side is in ``redis_store.py``, the thread in ``refresher.py``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, KeysView, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_output_rate.limiter import DEFAULT_BURST_NS, OutputRateLimiter
from vllm_output_rate.store.messages import (
    UNBOUNDED,
    Exchange,
    LeaseAsk,
    LimitsWrite,
    Round,
    StoredLimits,
)
from vllm_output_rate.store.settings import StoreSettings
from vllm_output_rate.validation import validate_rate, validate_user_name

NS = 1_000_000_000
# Slack for the engine's step between an answer's arrival and its use.
STEP_SLACK_S = 0.1
# A blocked user waiting for its first answer is looked at again this soon.
FIRST_ANSWER_POLL_NS = 2_000_000
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


@dataclass
class _Posted:
    """A round's outcome, waiting for the scheduler thread. Rounds in a row
    that asked, wrote and were granted nothing are one entry: an idle engine
    takes no steps to apply them, and its heartbeats (ten a second) piled up
    (a day idle: about 750 MB, and 2 s of applying at the next step)."""

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

    def absorb(self, later: _Posted) -> None:
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


class LeasedLimiter:
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
    ) -> None:
        self.settings = settings
        self.pacer = OutputRateLimiter(default_rate, burst_ns=burst_ns, clock=clock)
        self._clock = clock
        self._logger = logger or logging.getLogger("vllm.output_rate")
        self._default = self.pacer.default_rate
        self._overrides: dict[str, float] = {
            validate_user_name(u): validate_rate(r, f"rate of user {u!r}")
            for u, r in (user_rates or {}).items()
        }
        self.limits_version = 0
        self._lease_ns = round(settings.lease_s * NS)
        self._refresh_ns = round(settings.refresh_s * NS)
        self.grace_us = round(
            (settings.timeout_s + STEP_SLACK_S) * 1e6 + burst_ns / 1000
        )
        self._lock = threading.Lock()
        self.kick = threading.Event()  # the refresher's doorbell
        self._leases: dict[str, Lease] = {}
        self._renewals: list[tuple[int, int, str]] = []  # heap: due, seq, user
        self._seq = itertools.count()
        self._renew_all = False
        self._shared: set[str] = set()
        # Users with demand and no usable rate; the subset still waiting
        # for their first answer.
        self._blocked: set[str] = set()
        self._awaiting: set[str] = set()
        self._demand: Mapping[str, int] = {}
        self._generation: object = None
        self._has_requests: Callable[[], bool] = lambda: True
        self._results: list[_Posted] = []
        self._writes: list[LimitsWrite] = []
        self.degraded = False  # serving without the store
        # Sent time of the last round the store answered (at first: our
        # start). Rounds fail for a moment on a loaded machine; only after a
        # whole lease period without an answer does the engine fall back.
        self._answered_ns = clock()
        self._failing = False  # rounds are failing, not yet degraded
        self._failing_since_ns = 0
        self.engines_seen = max(1, engines_hint)
        self.counters = StoreCounters()
        self._started = False

    # ----- what the policy calls (the Budget interface) ---------------------

    @property
    def burst_ns(self) -> int:
        return self.pacer.burst_ns

    def now_ns(self) -> int:
        return self._clock()

    @property
    def default_rate(self) -> float:
        return self._default

    @property
    def user_rates(self) -> dict[str, float]:
        return dict(self._overrides)

    def rate_of(self, user: str) -> float:
        return self._overrides.get(user, self._default)

    @property
    def last_take_ns(self) -> int:
        return self.pacer.last_take_ns

    def take_many(self, wanted: Mapping[str, int]) -> dict[str, int]:
        blocked = self._blocked
        if blocked and not blocked.isdisjoint(wanted):
            got = self.pacer.take_many(
                {u: c for u, c in wanted.items() if u not in blocked}
            )
            got.update(dict.fromkeys(blocked.intersection(wanted), 0))
        else:
            got = self.pacer.take_many(wanted)
        if self._shared:
            leases = self._leases
            for user in self._shared.intersection(got):
                lease = leases.get(user)  # the refresher may have let it go
                if lease is not None:
                    lease.used += got[user]
                    if got[user] < wanted[user]:
                        lease.held_back += 1
        return got

    def take_up_to(self, user: str, wanted: int) -> int:
        return self.take_many({user: wanted})[user]

    def try_take(self, user: str) -> bool:
        return self.take_up_to(user, 1) == 1

    def refund(self, user: str, count: int = 1) -> None:
        self.pacer.refund(user, count)
        lease = self._leases.get(user) if self._shared else None
        if lease is not None and lease.shared and count > 0:
            lease.used -= count

    def refund_many(self, counts: Mapping[str, int]) -> None:
        for user, count in counts.items():
            self.refund(user, count)

    def refunds_absorbed(self, users: KeysView[str]) -> bool:
        # A shared user's refunds also go back to its lease.
        return self._shared.isdisjoint(users) and self.pacer.refunds_absorbed(users)

    def refund_late(
        self, user: str, count: int, later_takes: Iterable[tuple[int, int]] = ()
    ) -> None:
        """``OutputRateLimiter.refund_late`` at this engine's share (speculative
        decoding: drafts a later report says were rejected)."""
        self.pacer.refund_late(user, count, later_takes)
        lease = self._leases.get(user) if self._shared else None
        if lease is not None and lease.shared and count > 0:
            lease.used -= count

    def tokens_within(self, user: str, window_ns: int) -> int:
        """At this engine's share of the limit (none while it waits for one)."""
        if user in self._blocked:
            return 0
        return self.pacer.tokens_within(user, window_ns)

    def ready_at_ns(self, user: str) -> int:
        if user in self._blocked:
            now = self._clock()
            wait = FIRST_ANSWER_POLL_NS if user in self._awaiting else self._refresh_ns
            return now + wait
        return self.pacer.ready_at_ns(user)

    def cleanup_idle_users(self) -> int:
        return self.pacer.cleanup_idle_users()

    def __len__(self) -> int:
        return len(self.pacer)

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
        overrides = dict(self._overrides)
        for user in write.remove_users:
            overrides.pop(user, None)
        overrides.update(write.user_rates)
        self._apply_limits(
            self._default if write.default_rate is None else write.default_rate,
            overrides,
        )
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
        if self._shared:
            leases = self._leases
            for user in self._shared:
                lease = leases.get(user)
                if lease is not None:
                    lease.peak_demand = max(lease.peak_demand, demand.get(user, 0))
        if generation != self._generation or demand is not self._demand:
            with self._lock:
                self._demand, self._generation = demand, generation
                new = demand.keys() - self._leases.keys() - self._awaiting
                if new and not self.degraded:
                    self._blocked |= new
                    self._awaiting |= new
            if new:
                if self.degraded:
                    self.pacer.set_user_rates({u: self._fallback_rate(u) for u in new})
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
        with self._lock:
            demand = dict(self._demand) if self._has_requests() else {}
            leases = self._leases
            asks: dict[str, LeaseAsk] = {}
            for user in demand.keys() - leases.keys():
                asks[user] = LeaseAsk(user, demand[user])
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
                weight = self._weight(lease, demand.get(user, 0))
                if weight is None:
                    self._schedule(user, lease, self._refresh_ns, now)
                    continue  # idle for a moment: ask nothing, keep the share
                asks[user] = LeaseAsk(user, weight, self._want(lease, now, weight))
                lease.weight = weight
                if weight == 0:
                    # Given back: not used from now on (the user has no demand).
                    del leases[user]
                    self._shared.discard(user)
            writes, self._writes = self._writes, []
            return Round(
                list(asks.values()),
                now,
                self.limits_version,
                writes,
                (self._default, dict(self._overrides)),
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
            posted = _Posted(
                round_, exchange, limits, error, round_trip_s, round_trip_s
            )
            last = self._results[-1] if self._results else None
            if (
                last is not None
                and (last.exchange is None) == (exchange is None)
                and last.carries_nothing
                and posted.carries_nothing
            ):
                last.absorb(posted)
            else:
                self._results.append(posted)

    # ----- internals (scheduler thread) ----------------------------------

    def _pop_due(self, now: int) -> list[str]:
        heap, due = self._renewals, []
        while heap and heap[0][0] <= now:
            renew_ns, _, user = heapq.heappop(heap)
            lease = self._leases.get(user)
            if lease is not None and lease.renew_ns == renew_ns:
                due.append(user)
        return due

    def _weight(self, lease: Lease, now_demand: int) -> int | None:
        """The weight to report: a shared user's peak demand since the last
        ask; None (ask nothing yet) while it has been idle only briefly."""
        if not lease.shared:
            return now_demand
        peak, lease.peak_demand = max(lease.peak_demand, now_demand), 0
        if peak:
            lease.idle_asks = 0
            return peak
        lease.idle_asks += 1
        return None if lease.idle_asks < RELEASE_AFTER_IDLE_ASKS else 0

    def _want(self, lease: Lease, now: int, weight: float) -> float:
        """What this engine asks for: unbounded, unless the user is shared
        and was never held back since the last ask (then: what it used)."""
        if not lease.shared or weight == 0:
            return UNBOUNDED
        elapsed_s = max(1e-3, (now - lease.reported_ns) / NS)
        rate = (lease.used - lease.reported_used) / elapsed_s
        held_back = lease.held_back != lease.reported_held_back
        lease.reported_used, lease.reported_held_back = lease.used, lease.held_back
        lease.reported_ns = now
        lease.used_rate = (
            rate if not lease.used_rate else 0.5 * (lease.used_rate + rate)
        )
        if held_back:
            return UNBOUNDED
        return round(lease.used_rate * WANT_HEADROOM + WANT_EXTRA_TOK_S, 3)

    def _fallback_rate(self, user: str) -> float:
        share = self.settings.fallback_share or 1.0 / self.engines_seen
        return self.rate_of(user) * share

    def _schedule(self, user: str, lease: Lease, delay_ns: int, now: int) -> None:
        lease.renew_ns = now + delay_ns
        heapq.heappush(self._renewals, (lease.renew_ns, next(self._seq), user))

    def _apply_result(self, posted: _Posted) -> None:
        counters = self.counters
        round_, exchange, limits = posted.round, posted.exchange, posted.limits
        if exchange is None:
            counters.failures += posted.rounds
            counters.last_error = posted.error
            self._serve_without_store(posted.error, round_.sent_ns)
            return
        counters.exchanges += posted.rounds
        self._answered_ns = max(self._answered_ns, round_.sent_ns)
        self._stop_failing(self._clock())
        counters.asks += len(round_.asks)
        counters.rtt_sum_s += posted.rtt_sum_s
        counters.rtt_max_s = max(counters.rtt_max_s, posted.rtt_max_s)
        # Any other version: a restarted store counts from 1 again.
        if limits is not None and limits.version != self.limits_version:
            self._adopt_stored_limits(limits)
        self.engines_seen = max(1, exchange.engines)
        now = self._clock()
        rates: dict[str, float | None] = {}
        with self._lock:
            if self.degraded:
                self.degraded = False
                self._logger.warning(
                    "Output rate store %s reachable again: leases resumed",
                    self.settings.display_url,
                )
                # Users served at their fallback share go back to leases.
                rates.update(dict.fromkeys(self.pacer.user_rates, None))
            elif exchange.fresh and self._started:
                self._renew_all = True  # the store forgot us: it restarted
            self._started = True
            self._apply_rates(exchange, round_, now, rates)
            # Users that came while serving without the store (or after this
            # round was sent) wait for their lease like any new user.
            waiting = self._demand.keys() - self._leases.keys()
            self._blocked |= waiting
            self._awaiting |= waiting
        if rates:
            self.pacer.set_user_rates(rates)
        if waiting:
            self.kick.set()

    def _apply_rates(
        self,
        exchange: Exchange,
        round_: Round,
        now: int,
        rates: dict[str, float | None],
    ) -> None:
        leases, counters = self._leases, self.counters
        released = {ask.user for ask in round_.asks if ask.weight == 0}
        for user, rate in exchange.rates.items():
            if user in released:
                rates[user] = None
                continue
            lease = leases.get(user)
            if lease is None:
                if user not in self._awaiting and user not in self._demand:
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
            lease.expires_ns = round_.sent_ns + self._lease_ns
            lease.shared = user in exchange.shared
            self._awaiting.discard(user)
            if lease.shared:
                self._shared.add(user)
            else:
                self._shared.discard(user)
            if rate > 0:
                self._blocked.discard(user)
                rates[user] = None if rate == self._default else rate
            else:
                self._blocked.add(user)
            # Shared or starved users are asked about every cycle.
            contended = lease.shared or rate <= 0
            self._schedule(
                user, lease, self._refresh_ns if contended else self._lease_ns // 2, now
            )
        counters.returns += len(released)

    def _serve_without_store(self, error: str, sent_ns: int) -> None:
        """A failed round. For up to one lease period since the last answer
        it is a blip, and the engine keeps within what the store counts for
        it: users without a usable lease wait (the store still counts the
        other engines' leases, so a fallback share here could break the
        global bound); so do shared users, whose share the failed round may
        have lowered at the store (the reply lost) while the lowered part
        goes to another engine after the grace; unshared leases hold until
        they expire. The next round renews every lease. After a whole lease
        period without an answer the store is unreachable: every user gets
        its fallback share; nobody is blocked."""
        now = self._clock()
        rates: dict[str, float | None] = {}
        # Judged by when the failed round was sent, not by now: an idle
        # engine applies its rounds only at its next step, and a blip while
        # it was idle is no reason to fall back when traffic returns.
        silent_ns = sent_ns - self._answered_ns
        if not self.degraded and silent_ns < self._lease_ns:
            with self._lock:
                if not self._failing:
                    self._failing = True
                    self._failing_since_ns = now
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
                self._renew_all = True
                for user, lease in self._leases.items():
                    if lease.shared or lease.expires_ns <= now:
                        self._blocked.add(user)
            return
        with self._lock:
            if not self.degraded:
                self._stop_failing(now)
                self.degraded = True
                self.counters.fallbacks += 1
                self._logger.warning(
                    "Output rate store unreachable (%s): serving leases until they "
                    "expire, then each user at %s of its limit",
                    error,
                    (
                        f"{self.settings.fallback_share:g}"
                        if self.settings.fallback_share
                        else f"1/{self.engines_seen} (engines last seen)"
                    ),
                )
            for user in self._blocked:
                rates[user] = self._fallback_rate(user)
            self._blocked.clear()
            self._awaiting.clear()
            for user, lease in list(self._leases.items()):
                if lease.expires_ns <= now:
                    rates[user] = self._fallback_rate(user)
                    del self._leases[user]
                    self._shared.discard(user)
            for user in self._demand.keys() - self._leases.keys():
                rates.setdefault(user, self._fallback_rate(user))
        if rates:
            self.pacer.set_user_rates(rates)

    def _stop_failing(self, now: int) -> None:
        if self._failing:
            self._failing = False
            self.counters.failing_s += (now - self._failing_since_ns) / NS

    def _apply_limits(self, default: float, overrides: dict[str, float]) -> None:
        """New configured limits: lowered limits lower leases at once."""
        old_default, old_overrides = self._default, self._overrides
        self._default, self._overrides = default, overrides
        if default != old_default:
            self.pacer.update_rates(default_rate=default)
        changed = {
            user
            for user in old_overrides.keys() | overrides.keys()
            if old_overrides.get(user, old_default) != overrides.get(user, default)
        }
        if default != old_default:
            changed |= self._leases.keys()
        rates: dict[str, float | None] = {}
        now = self._clock()
        with self._lock:
            for user in changed:
                lease = self._leases.get(user)
                old = old_overrides.get(user, old_default)
                new = overrides.get(user, default)
                if lease is not None:
                    if new < old and lease.rate > 0:
                        lease.rate = round(lease.rate * new / old, 3) or 0.001
                    self._schedule(user, lease, 0, now)
                    if lease.rate > 0 and not self.degraded:
                        rates[user] = None if lease.rate == default else lease.rate
                if self.degraded and (lease is None or lease.expires_ns <= now):
                    rates[user] = self._fallback_rate(user)
        if rates:
            self.pacer.set_user_rates(rates)

    def _adopt_stored_limits(self, limits: StoredLimits) -> None:
        if (limits.default_rate, limits.user_rates) != (
            self._default,
            self._overrides,
        ):
            self._logger.info(
                "Output rate limits from the store (version %d): default %s tok/s, "
                "%d user override(s)",
                limits.version,
                limits.default_rate,
                len(limits.user_rates),
            )
            self._apply_limits(limits.default_rate, dict(limits.user_rates))
        self.limits_version = limits.version

    # ----- observers -------------------------------------------------------

    def store_snapshot(self) -> dict[str, Any]:
        counters = self.counters
        return {
            "url": self.settings.display_url,
            "degraded": self.degraded,
            "engines_seen": self.engines_seen,
            "leases": len(self._leases),
            "shared_users": len(self._shared),
            "blocked_users": len(self._blocked),
            "exchanges": counters.exchanges,
            "asks": counters.asks,
            "failures": counters.failures,
            "fallbacks": counters.fallbacks,
            "grants": counters.grants,
            "returns": counters.returns,
            "rtt_sum_s": counters.rtt_sum_s,
            "rtt_max_s": counters.rtt_max_s,
            "failing_s": self.failing_seconds(),
            "limits_version": self.limits_version,
        }

    def failing_seconds(self) -> float:
        """Seconds shared and new users waited on failed rounds so far,
        the current run of failures included."""
        ongoing = self._clock() - self._failing_since_ns if self._failing else 0
        return self.counters.failing_s + ongoing / NS

    def lease_rate(self, user: str) -> float | None:
        """This engine's share of ``user``'s limit (None: no lease)."""
        lease = self._leases.get(user)
        return None if lease is None else lease.rate
