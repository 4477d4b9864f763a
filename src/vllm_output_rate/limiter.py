"""Per-user output-token rate limiter: GCRA with exact integer arithmetic.

``OutputRateLimiter`` keeps, per user, the theoretical arrival time (TAT) of
its next token at its rate, in ``exact_rate.ScaledRate``'s units, so nothing
rounds while tokens are taken. A token is admitted while the TAT is at most
the burst (``DEFAULT_BURST_NS``, 100 ms) ahead of now, and moves it one
interval on: over any window of W seconds a user gets at most
``(W + burst) × rate + 1`` tokens, evenly spread. It only keeps accounts
(which request gets a token is the scheduler's decision) and is the
engine's own ``budget.Budget``. Pure Python, never imports vLLM. The
algorithm, its bound and the group of free users: docs/architecture.md,
"The limiter".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, KeysView, Mapping
from typing import Any

from vllm_output_rate.exact_rate import ScaledRate
from vllm_output_rate.validation import validate_rate, validate_user_name

DEFAULT_BURST_NS = 100_000_000  # 100 ms, as in the specification


class OutputRateLimiter:
    """GCRA budget of output tokens per second, shared by all of a user's requests.

    ``default_rate`` applies to every user not named in ``user_rates``.
    Default-rate users that are free and get all they ask for share one
    record, the *group* (one clock reading and a count each), instead of a
    TAT each; decisions are the same either way.
    """

    def __init__(
        self,
        default_rate: float,
        user_rates: Mapping[str, float] | None = None,
        *,
        burst_ns: int = DEFAULT_BURST_NS,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if isinstance(burst_ns, bool) or not isinstance(burst_ns, int) or burst_ns < 0:
            raise ValueError(f"burst_ns must be an integer >= 0, got {burst_ns!r}")
        self._burst_ns = burst_ns
        self._clock = clock
        self._default = self._scaled(default_rate, "default rate")
        self._overrides: dict[str, ScaledRate] = {}
        for user, rate in (user_rates or {}).items():
            validate_user_name(user)
            self._overrides[user] = self._scaled(rate, f"rate of user {user!r}")
        # user -> TAT in that user's scaled nanoseconds. A user without an
        # entry behaves exactly like one whose TAT is in the past.
        self._tat: dict[str, int] = {}
        # The group (see the class docstring): default-rate users whose TAT
        # is group_now * scale + taken * interval. Never also in _tat.
        self._group_now_ns = 0
        # The clock reading of the last take_many (the dispatch log's stamp).
        self.last_take_ns = 0
        self._group_taken: dict[str, int] = {}

    @property
    def burst_ns(self) -> int:
        return self._burst_ns

    def now_ns(self) -> int:
        return self._clock()

    def _scaled(self, rate: float, what: str) -> ScaledRate:
        return ScaledRate.from_rate(validate_rate(rate, what), self._burst_ns)

    def rate_of(self, user: str) -> float:
        return self._overrides.get(user, self._default).per_second

    @property
    def default_rate(self) -> float:
        return self._default.per_second

    @property
    def user_rates(self) -> dict[str, float]:
        return {user: self.rate_of(user) for user in self._overrides}

    def update_rates(
        self,
        *,
        default_rate: float | None = None,
        user_rates: Mapping[str, float] | None = None,
        remove_users: Iterable[str] = (),
    ) -> None:
        """Change limits in place, all or nothing.

        Every user keeps the absolute time its next token is due (its TAT),
        re-expressed in the new rate's units and rounded up, so a change
        grants no burst; tokens after that one follow the new spacing. Bad
        input raises ValueError and changes nothing.
        """
        self._materialize_group()  # its TATs are in the old default's units
        new_default = (
            self._default
            if default_rate is None
            else self._scaled(default_rate, "default rate")
        )
        overrides = dict(self._overrides)
        for user in remove_users:
            validate_user_name(user)
            overrides.pop(user, None)
        for user, rate in (user_rates or {}).items():
            validate_user_name(user)
            overrides[user] = self._scaled(rate, f"rate of user {user!r}")
        for user, tat in self._tat.items():
            old = self._overrides.get(user, self._default)
            new = overrides.get(user, new_default)
            if new is not old:
                self._tat[user] = old.rescaled(tat, new)
        self._default, self._overrides = new_default, overrides

    def set_user_rates(self, rates: Mapping[str, float | None]) -> None:
        """Give a few users their own rate (None: back to the default).

        Like ``update_rates`` (each keeps the absolute due time of its next
        token, so no burst), but its cost grows with the users named, not
        with every user that has state: a shared store (``store/``) changes
        a few users' local shares at a time.
        """
        changed: dict[str, ScaledRate | None] = {}
        for user, rate in rates.items():
            validate_user_name(user)
            changed[user] = (
                None if rate is None else self._scaled(rate, f"rate of user {user!r}")
            )
        if self._group_taken.keys() & changed.keys():
            self._materialize_group()  # those TATs are in the default's units
        overrides, default, tats = self._overrides, self._default, self._tat
        for user, new in changed.items():
            old = overrides.get(user, default)
            if new is None:
                overrides.pop(user, None)
                new = default
            else:
                overrides[user] = new
            tat = tats.get(user)
            if tat is not None and new.scale != old.scale:
                tats[user] = old.rescaled(tat, new)

    def try_take(self, user: str) -> bool:
        """Admit one output token for ``user`` now, or refuse and change nothing."""
        return self.take_up_to(user, 1) == 1

    def take_up_to(self, user: str, wanted: int) -> int:
        """Admit up to ``wanted`` tokens for ``user`` now; return how many.

        Exactly equivalent to calling ``try_take`` that many times at the same
        clock reading, but O(1): the scheduler reserves a user's allowance for
        a whole step with one call instead of one call per request.
        """
        return self.take_many({user: wanted})[user]

    def take_many(self, wanted: Mapping[str, int]) -> dict[str, int]:
        """``take_up_to`` for several users at one clock reading.

        Returns how many tokens each user got. The scheduler reserves every
        user's allowance for a step with this one call, because with
        hundreds of users a call per user showed in the step time.
        """
        clock_ns = self.last_take_ns = self._clock()
        if wanted and wanted == self._group_taken and self._group_is_free(clock_ns):
            # Steady decoding: the group asks for the same again and every
            # member is free, so it is renewed at this clock reading.
            self._group_now_ns = clock_ns
            self._group_taken = dict(wanted)
            return dict(wanted)
        if "" in wanted:
            validate_user_name("")
        # Users with their own rate are always taken one by one; everyone
        # else together, as the group, when possible.
        own_rate = self._overrides.keys() & wanted.keys()
        group = dict(wanted)
        for user in own_rate:
            del group[user]
        if self._can_be_group(group, clock_ns):
            self._group_now_ns = clock_ns
            self._group_taken = group
            got = dict(group)
            if own_rate:
                got.update(self._take_each({u: wanted[u] for u in own_rate}, clock_ns))
            return got
        self._materialize_group()
        return self._take_each(wanted, clock_ns)

    def _take_each(self, wanted: Mapping[str, int], clock_ns: int) -> dict[str, int]:
        """The GCRA step for each user, on per-user TATs."""
        overrides, default, tats = self._overrides, self._default, self._tat
        default_now = clock_ns * default.scale  # most users have the default
        got: dict[str, int] = {}
        for user, count in wanted.items():
            rate = overrides.get(user)
            if rate is None:
                rate, now = default, default_now
            else:
                now = clock_ns * rate.scale
            tat = tats.get(user, now)
            if tat < now:
                tat = now
            headroom = now + rate.burst - tat
            if headroom < 0 or count <= 0:
                got[user] = 0
                continue
            taken = got[user] = min(count, headroom // rate.interval + 1)
            tats[user] = tat + taken * rate.interval
        return got

    def _can_be_group(self, group: dict[str, int], clock_ns: int) -> bool:
        """Whether every default-rate user in ``group`` is free now and gets
        its count in full, so that ``group`` can replace the current group.

        Each check is a C-level operation over the users (``max``, ``&``)
        except for users with a per-user TAT, which are looked at one by one
        (and leave it: they join the group at most once in a row).
        """
        if not group or not self._group_is_free(clock_ns):
            return False
        default = self._default
        counts = group.values()
        if min(counts) < 1 or max(counts) > default.burst // default.interval + 1:
            return False  # not granted in full (or a count of 0)
        tats = self._tat
        with_tat = tats.keys() & group.keys() if tats else None
        if with_tat:
            now = clock_ns * default.scale
            if any(tats[user] > now for user in with_tat):
                return False
            for user in with_tat:
                del tats[user]  # in the past: the same as no entry
        # Current members not asking now are free: forgetting them is exact.
        return True

    def _group_is_free(self, clock_ns: int) -> bool:
        """Whether no member of the current group is ahead of ``clock_ns``
        (the one with the largest count decides)."""
        current = self._group_taken
        if not current:
            return True
        default = self._default
        elapsed = (clock_ns - self._group_now_ns) * default.scale
        return max(current.values()) * default.interval <= elapsed

    def _materialize_group(self) -> None:
        """Turn the group back into per-user TATs."""
        if not self._group_taken:
            return
        for user, taken in self._group_taken.items():
            self._tat[user] = self._group_tat(taken)
        self._group_taken = {}

    def _group_tat(self, taken: int) -> int:
        """The TAT of a group member that took ``taken`` tokens."""
        default = self._default
        return self._group_now_ns * default.scale + taken * default.interval

    def _tat_of(self, user: str) -> int | None:
        taken = self._group_taken.get(user)
        if taken is None:
            return self._tat.get(user)
        return self._group_tat(taken)

    def refund(self, user: str, count: int = 1) -> None:
        """Give back ``count`` tokens taken earlier in the same scheduler step."""
        if count > 0:
            self._give_back(user, count)

    def _give_back(self, user: str, count: int) -> None:
        if user in self._group_taken:
            self._group_taken[user] -= count
            return
        tat = self._tat.get(user)
        if tat is None:
            return  # nothing was taken (or the state was already idle)
        rate = self._overrides.get(user, self._default)
        self._tat[user] = tat - count * rate.interval

    def tokens_within(self, user: str, window_ns: int) -> int:
        """The most tokens ``user``'s limit admits in any window of
        ``window_ns``: ``(W + burst) x rate + 1``, rounded down (exact).

        With ``window_ns == 0`` it is the most one clock reading can grant.
        """
        rate = self._overrides.get(user, self._default)
        return (max(0, window_ns) * rate.scale + rate.burst) // rate.interval + 1

    def refund_many(self, counts: Mapping[str, int]) -> None:
        """``refund`` for several users (one call for a step's refunds).

        A refund to a user whose TAT is not ahead of now changes nothing a
        later call can see (the next take clamps the TAT to its clock, which
        never goes back): while the whole group is free, its members'
        refunds are skipped, which keeps the group as it was, so that the
        next step's same take is renewed in O(1) (speculative decoding's
        rejected drafts, users far below their limits)."""
        if self.refunds_absorbed(counts.keys()):
            return
        give_back = self._give_back
        for user, count in counts.items():
            if count > 0:
                give_back(user, count)

    def refunds_absorbed(self, users: KeysView[str]) -> bool:
        """Whether refunds to ``users`` now would change nothing a later
        call can see (``refund_many``: all of them are members of the group
        and the whole group is free)."""
        group = self._group_taken
        return (
            bool(group) and users <= group.keys() and self._group_is_free(self._clock())
        )

    def refund_late(
        self,
        user: str,
        count: int,
        later_takes: Iterable[tuple[int, int]] = (),
    ) -> None:
        """Give back ``count`` tokens of a take made in an earlier step,
        ending in the state GCRA would have reached had that take been
        ``count`` smaller (``refund`` when there are no ``later_takes``).

        ``later_takes``: oldest first, the takes of ``user`` since then that
        kept at least one token, as ``(clock_ns, kept)`` (a later clock
        reading only makes the result stricter). Why: docs/architecture.md,
        "Engine modes".
        """
        if count <= 0:
            return
        rate = self._overrides.get(user, self._default)
        floor: int | None = None
        for clock_ns, kept in later_takes:
            now = clock_ns * rate.scale
            floor = (now if floor is None or floor < now else floor) + (
                kept * rate.interval
            )
        if floor is None:
            self._give_back(user, count)
            return
        tat = self._tat_of(user)
        if tat is None:
            return  # nothing is ahead of now: nothing to give back
        self._group_taken.pop(user, None)
        self._tat[user] = max(tat - count * rate.interval, floor)

    def ready_at_ns(self, user: str) -> int:
        """Earliest clock reading at which ``try_take(user)`` can succeed.

        Rounded up, so it is never early. A user who may take a token now gets
        the current clock reading.
        """
        now = self._clock()
        tat = self._tat_of(user)
        if tat is None:
            return now
        rate = self._overrides.get(user, self._default)
        ready = -((rate.burst - tat) // rate.scale)  # ceil((tat - burst) / p)
        return max(ready, now)

    def cleanup_idle_users(self) -> int:
        """Forget users whose TAT is not ahead of now; return how many.

        Such a user is indistinguishable from one never seen (``try_take``
        clamps a past TAT to now), and clocks never go back, so removing them
        cannot change any later decision. Cost is linear in the users seen
        since the previous cleanup, so call it periodically.
        """
        self._materialize_group()
        now = self._clock()
        idle = [
            user
            for user, tat in self._tat.items()
            if tat <= now * self._overrides.get(user, self._default).scale
        ]
        for user in idle:
            del self._tat[user]
        return len(idle)

    def __len__(self) -> int:
        """Number of users with state (those not idle at the last cleanup)."""
        return len(self._tat) + len(self._group_taken)

    # ----- what a shared store's limiter adds (budget.Budget): nothing here

    def attach(self, has_requests: Callable[[], bool]) -> None:
        """The engine's own budget needs no view of the engine."""

    def between_steps(self, demand: Mapping[str, int], generation: object) -> None:
        """Nothing to synchronise: the budget is this engine's own."""

    def apply_pending(self) -> None:
        """Nothing arrives from elsewhere."""

    def store_snapshot(self) -> dict[str, Any] | None:
        """No shared store: nothing to show."""
        return None
