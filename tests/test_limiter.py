"""The GCRA limiter on its own, driven by a fake clock."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bounds import assert_window_bound
from harness.fake_clock import FakeClock
from vllm_output_rate.exact_rate import NS_PER_SECOND
from vllm_output_rate.limiter import OutputRateLimiter

BURST_NS = 100_000_000
MS = 1_000_000


def window_bound(window_ns: int, rate: float, burst_ns: int = BURST_NS) -> Fraction:
    """(W + burst) * rate + 1, exactly."""
    return Fraction(window_ns + burst_ns, NS_PER_SECOND) * Fraction(repr(rate)) + 1


RATES = st.sampled_from([0.1, 0.5, 1, 2.5, 3.7, 10, 33.3, 100, 1234.5, 5000])


def test_article_timeline() -> None:
    """limit 10 tok/s, 4 streams, a step every 30 ms (the specification's table)."""
    clock = FakeClock()
    limiter = OutputRateLimiter(10, clock=clock)
    admitted: dict[int, int] = {}
    for step in range(11):
        clock.now_ns = step * 30 * MS
        admitted[step * 30] = sum(limiter.try_take("a") for _ in range(4))
    assert admitted == {
        0: 2, 30: 0, 60: 0, 90: 0, 120: 1, 150: 0,
        180: 0, 210: 1, 240: 0, 270: 0, 300: 1,
    }  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    rate=RATES,
    steps=st.lists(
        st.tuples(st.integers(0, 400 * MS), st.integers(0, 30)),
        min_size=1,
        max_size=120,
    ),
)
def test_window_bound_holds_for_any_steps_and_demand(
    rate: float, steps: list[tuple[int, int]]
) -> None:
    clock = FakeClock(12_345)
    limiter = OutputRateLimiter(rate, clock=clock)
    admitted_at: list[int] = []
    for gap_ns, demand in steps:
        clock.advance(gap_ns)
        for _ in range(demand):
            if limiter.try_take("u"):
                admitted_at.append(clock.now_ns)
    assert_window_bound(admitted_at, rate)


@settings(max_examples=100, deadline=None)
@given(
    rate=RATES,
    gaps=st.lists(st.integers(1, BURST_NS), min_size=50, max_size=400),
)
def test_continuous_demand_reaches_the_rate(rate: float, gaps: list[int]) -> None:
    """With step gaps no longer than the burst, no credit is ever lost."""
    clock = FakeClock()
    limiter = OutputRateLimiter(rate, clock=clock)
    count = 0
    for gap in [0, *gaps]:
        clock.advance(gap)
        while limiter.try_take("u"):
            count += 1
    elapsed = clock.now_ns
    # Exactly floor((t + burst) * rate) + 1 tokens by time t: GCRA never fell
    # behind, so the TAT advanced by one interval per admitted token.
    expected = math.floor(window_bound(elapsed, rate) - 1) + 1
    assert count == expected


@pytest.mark.parametrize("rate", [1234.5, 987.6])
def test_no_drift_over_millions_of_tokens(rate: float) -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(rate, clock=clock)
    count = 0
    step_ns = 7 * MS + 3  # deliberately not a multiple of the interval
    while True:
        while limiter.try_take("u"):
            count += 1
        if count >= 2_000_000:
            break
        clock.advance(step_ns)
    expected = math.floor(window_bound(clock.now_ns, rate) - 1) + 1
    assert count == expected


def test_users_do_not_share_budgets() -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(10, {"vip": 100}, clock=clock)
    assert limiter.rate_of("vip") == 100
    assert limiter.rate_of("anyone") == 10
    taken = {user: 0 for user in ("a", "b", "vip")}
    for _ in range(100):
        clock.advance(10 * MS)
        for user in taken:
            taken[user] += limiter.try_take(user)
    # 1 s of steps: each default user gets ~ (1 + 0.1) * 10 + 1 at most.
    assert taken["a"] == taken["b"] == 11
    assert taken["vip"] == 100  # one per step: never throttled


def test_refusal_changes_nothing_and_refund_restores() -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(10, clock=clock)
    assert limiter.try_take("u") and limiter.try_take("u")
    ready = limiter.ready_at_ns("u")
    assert not limiter.try_take("u")
    assert limiter.ready_at_ns("u") == ready  # a refusal leaves no trace
    limiter.refund("u")
    assert limiter.try_take("u")  # the refunded token is available again
    assert not limiter.try_take("u")


def test_refund_of_unknown_user_is_harmless() -> None:
    limiter = OutputRateLimiter(10, clock=FakeClock())
    limiter.refund("never-seen")
    assert limiter.try_take("never-seen")


@settings(max_examples=200, deadline=None)
@given(
    rate=RATES,
    takes=st.integers(1, 50),
    gap=st.integers(0, 2 * NS_PER_SECOND),
)
def test_ready_at_is_exact_and_never_early(rate: float, takes: int, gap: int) -> None:
    clock = FakeClock(1_000)
    limiter = OutputRateLimiter(rate, clock=clock)
    for _ in range(takes):
        limiter.try_take("u")
    clock.advance(gap)
    ready = limiter.ready_at_ns("u")
    if ready > clock.now_ns:
        clock.now_ns = ready - 1
        assert not limiter.try_take("u")
        clock.now_ns = ready
    assert limiter.try_take("u")


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 300 * MS),  # clock advance
            st.sampled_from(["a", "b", "c", "vip"]),
            st.sampled_from(["take", "refund", "cleanup"]),
        ),
        max_size=200,
    )
)
def test_cleanup_never_changes_a_decision(ops: list[tuple[int, str, str]]) -> None:
    clock = FakeClock()
    kept = OutputRateLimiter(2.5, {"vip": 40}, clock=clock)
    cleaned = OutputRateLimiter(2.5, {"vip": 40}, clock=clock)
    taken_this_step: dict[str, int] = {}
    for advance, user, op in ops:
        if advance:
            clock.advance(advance)
            taken_this_step.clear()  # refunds only happen within one step
        if op == "take":
            decision = kept.try_take(user)
            assert cleaned.try_take(user) == decision
            taken_this_step[user] = taken_this_step.get(user, 0) + decision
        elif op == "refund" and taken_this_step.get(user):
            kept.refund(user)
            cleaned.refund(user)
            taken_this_step[user] -= 1
        elif op == "cleanup" and not taken_this_step:
            cleaned.cleanup_idle_users()
        assert kept.ready_at_ns(user) == cleaned.ready_at_ns(user)


def test_memory_stays_bounded_with_a_million_users() -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(5, clock=clock)
    peak = 0
    for i in range(1_000_000):
        limiter.try_take(f"user-{i}")
        if i % 1_000 == 999:
            clock.advance(10 * MS)  # a scheduler step
        if i % 16_000 == 15_999:
            limiter.cleanup_idle_users()  # every 16 steps
        peak = max(peak, len(limiter))
    # A user's TAT is 200 ms ahead after one token at 5 tok/s, so only the
    # users of the last 20 steps (20,000) survive a cleanup; 16 more steps
    # (16,000 users) arrive before the next one.
    assert peak <= 37_000
    clock.advance(NS_PER_SECOND)
    assert limiter.cleanup_idle_users() > 0
    assert len(limiter) == 0


@pytest.mark.parametrize("bad", [0, -1, -0.5, math.nan, math.inf, -math.inf])
def test_bad_rates_are_rejected_naming_the_value(bad: float) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        OutputRateLimiter(bad)
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        OutputRateLimiter(10, {"u": bad})


@pytest.mark.parametrize("bad", [True, "10", None])
def test_non_numeric_rates_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="tokens per second"):
        OutputRateLimiter(bad)  # type: ignore[arg-type]


def test_empty_user_is_rejected() -> None:
    with pytest.raises(ValueError, match="''"):
        OutputRateLimiter(10, {"": 5})
    limiter = OutputRateLimiter(10)
    with pytest.raises(ValueError, match="''"):
        limiter.try_take("")


@settings(max_examples=200, deadline=None)
@given(
    rate=RATES,
    steps=st.lists(
        st.tuples(st.integers(0, 300 * MS), st.integers(0, 40), st.integers(0, 40)),
        max_size=60,
    ),
)
def test_take_up_to_equals_repeated_try_take(
    rate: float, steps: list[tuple[int, int, int]]
) -> None:
    clock = FakeClock()
    one_by_one = OutputRateLimiter(rate, clock=clock)
    batched = OutputRateLimiter(rate, clock=clock)
    for advance, wanted, unused in steps:
        clock.advance(advance)
        taken = 0
        while taken < wanted and one_by_one.try_take("u"):
            taken += 1
        assert batched.take_up_to("u", wanted) == taken
        # Reserving more than needed and refunding the rest changes nothing.
        extra = batched.take_up_to("u", unused)
        batched.refund("u", extra)
        assert batched.ready_at_ns("u") == one_by_one.ready_at_ns("u")


@settings(max_examples=150, deadline=None)
@given(
    old=RATES,
    new=RATES,
    taken=st.integers(1, 60),
    advance=st.integers(0, 2 * NS_PER_SECOND),
)
def test_a_rate_change_grants_no_burst_and_keeps_the_due_time(
    old: float, new: float, taken: int, advance: int
) -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(old, clock=clock)
    for _ in range(taken):
        limiter.try_take("u")
    clock.advance(advance)
    due_before = limiter.ready_at_ns("u")
    limiter.update_rates(user_rates={"u": new})
    assert limiter.rate_of("u") == new
    # The next token is due no earlier than before (rounding may add < 1 ns
    # per unit of the new scale), and from then on the new spacing applies.
    assert due_before <= limiter.ready_at_ns("u") <= due_before + 1
    clock.now_ns = max(clock.now_ns, limiter.ready_at_ns("u"))
    admitted = []
    for _ in range(400):
        while limiter.try_take("u"):
            admitted.append(clock.now_ns)
        clock.advance(10 * MS)
    assert_window_bound(admitted, new)


def test_rate_updates_are_all_or_nothing() -> None:
    limiter = OutputRateLimiter(10, {"a": 5}, clock=FakeClock())
    with pytest.raises(ValueError, match="-1"):
        limiter.update_rates(default_rate=20, user_rates={"b": 7, "c": -1})
    assert limiter.default_rate == 10 and limiter.user_rates == {"a": 5}
    limiter.update_rates(default_rate=20, user_rates={"b": 7}, remove_users=["a"])
    assert limiter.default_rate == 20 and limiter.user_rates == {"b": 7}
    assert limiter.rate_of("a") == 20


class ReferenceGcra:
    """GCRA as the specification states it, per user, in exact fractions of a
    second: independent of the limiter's scaled integers and its group."""

    def __init__(self, default: float, users: dict[str, float]) -> None:
        self.default = Fraction(repr(default))
        self.rates = {u: Fraction(repr(r)) for u, r in users.items()}
        self.burst = Fraction(BURST_NS, NS_PER_SECOND)
        self.tat: dict[str, Fraction] = {}

    def rate(self, user: str) -> Fraction:
        return self.rates.get(user, self.default)

    def take(self, user: str, wanted: int, now_ns: int) -> int:
        now = Fraction(now_ns, NS_PER_SECOND)
        tat = max(self.tat.get(user, now), now)
        if tat - now > self.burst or wanted <= 0:
            return 0
        taken = min(wanted, math.floor((now + self.burst - tat) * self.rate(user)) + 1)
        self.tat[user] = tat + taken / self.rate(user)
        return taken

    def refund(self, user: str, count: int) -> None:
        if user in self.tat and count > 0:
            self.tat[user] -= count / self.rate(user)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        if user not in self.tat:
            return now_ns
        return max(math.ceil((self.tat[user] - self.burst) * NS_PER_SECOND), now_ns)

    def set_rate(self, user: str | None, rate: float) -> None:
        """A rate change keeps each affected user's due time, rounded up to
        the nanosecond."""
        if user is not None:
            # Whether it had its own rate or the default, its rate changes.
            affected = [u for u in self.tat if u == user]
            self.rates[user] = Fraction(repr(rate))
        else:
            affected = [u for u in self.tat if u not in self.rates]
            self.default = Fraction(repr(rate))
        for u in affected:
            due_ns = math.ceil(self.tat[u] * NS_PER_SECOND)
            self.tat[u] = Fraction(due_ns, NS_PER_SECOND)


LIMITER_USERS = ["own-rate", "u1", "u2", "u3"]
OPS = st.one_of(
    st.tuples(st.just("advance"), st.integers(0, 400 * MS)),
    st.tuples(
        st.just("take"),
        st.dictionaries(st.sampled_from(LIMITER_USERS), st.integers(0, 30)),
    ),
    st.tuples(st.just("refund"), st.sampled_from(LIMITER_USERS), st.integers(0, 5)),
    st.tuples(
        st.just("refund_many"),
        st.dictionaries(st.sampled_from(LIMITER_USERS), st.integers(0, 5)),
    ),
    st.tuples(st.just("cleanup")),
    st.tuples(st.just("rate"), st.sampled_from([None, "own-rate", "u2"]), RATES),
)


@settings(max_examples=300, deadline=None)
@given(default=RATES, own=RATES, ops=st.lists(OPS, max_size=60))
def test_the_limiter_matches_a_reference_gcra(
    default: float, own: float, ops: list[tuple]
) -> None:
    # take_many, the group of free default-rate users, refunds (one and
    # many), rate changes and cleanup, against the plain per-user formula.
    clock = FakeClock()
    limiter = OutputRateLimiter(default, {"own-rate": own}, clock=clock)
    reference = ReferenceGcra(default, {"own-rate": own})
    for op in ops:
        kind = op[0]
        if kind == "advance":
            clock.advance(op[1])
        elif kind == "take":
            expected = {u: reference.take(u, n, clock.now_ns) for u, n in op[1].items()}
            assert limiter.take_many(op[1]) == expected
        elif kind == "refund":
            limiter.refund(op[1], op[2])
            reference.refund(op[1], op[2])
        elif kind == "refund_many":
            # (skipped inside the limiter while the whole group is free)
            limiter.refund_many(op[1])
            for user, count in op[1].items():
                reference.refund(user, count)
        elif kind == "cleanup":
            limiter.cleanup_idle_users()
        else:
            user, rate = op[1], op[2]
            limiter.update_rates(
                default_rate=rate if user is None else None,
                user_rates=None if user is None else {user: rate},
            )
            reference.set_rate(user, rate)
        now = clock.now_ns
        for user in LIMITER_USERS:
            assert limiter.ready_at_ns(user) == reference.ready_at_ns(user, now)


def test_users_far_below_their_limit_share_one_record() -> None:
    # The group: no per-user TAT while everyone gets what it asks for.
    clock = FakeClock()
    limiter = OutputRateLimiter(1000)
    limiter._clock = clock
    demand = {f"user-{i}": 1 for i in range(100)}
    for _ in range(5):
        assert limiter.take_many(demand) == demand
        clock.advance(5 * MS)  # 1 token per 5 ms is below 1000 tok/s
    assert not limiter._tat and len(limiter._group_taken) == 100
    assert limiter.take_many({"user-0": 200}) == {"user-0": 101}  # burst ends
    assert "user-0" in limiter._tat


def test_a_refund_inside_the_group_is_exact() -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(10, clock=clock)  # 2 tokens fit in the burst
    assert limiter.take_many({"a": 2, "b": 1}) == {"a": 2, "b": 1}
    limiter.refund("a", 2)  # not dispatched after all
    assert limiter.take_many({"a": 2}) == {"a": 2}


def test_group_refunds_apply_unless_every_member_is_free() -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(10, clock=clock)  # 2 tokens fit in the burst
    assert limiter.take_many({"a": 2, "b": 1}) == {"a": 2, "b": 1}
    # Same clock reading: the members are ahead of it, the refund counts.
    limiter.refund_many({"a": 2, "b": 1})
    assert limiter.take_many({"a": 2, "b": 1}) == {"a": 2, "b": 1}
    # 300 ms later every member's TAT is past: skipping the refund leaves
    # the limiter where GCRA with the refund would be.
    clock.advance(300 * MS)
    limiter.refund_many({"a": 1})
    assert limiter.take_many({"a": 3}) == {"a": 2}
    limiter.refund_many({"a": 2})  # ahead again: given back
    assert limiter.take_many({"a": 3}) == {"a": 2}


def test_take_many_rejects_an_empty_user_name() -> None:
    with pytest.raises(ValueError, match="''"):
        OutputRateLimiter(10).take_many({"": 1})


@settings(max_examples=200, deadline=None)
@given(rate=RATES, window=st.integers(0, 3 * NS_PER_SECOND))
def test_tokens_within_a_window_is_what_the_limit_admits(
    rate: float, window: int
) -> None:
    clock = FakeClock()
    limiter = OutputRateLimiter(rate, {"own": rate / 2}, clock=clock)
    most = limiter.tokens_within("u", window)
    assert most == math.floor(window_bound(window, rate))
    assert limiter.tokens_within("own", window) == math.floor(
        window_bound(window, rate / 2)
    )
    # An idle user asking all the time, from the window's start to its end,
    # gets the burst at once and then one token per interval: the bound, or
    # one less where the two roundings fall apart.
    taken = limiter.take_up_to("u", 10**9)
    assert taken == limiter.tokens_within("u", 0)
    step = max(1, window // 200)
    while clock.now_ns + step <= window:
        clock.advance(step)
        taken += limiter.take_up_to("u", 10**9)
    clock.now_ns = window
    taken += limiter.take_up_to("u", 10**9)
    assert most - 1 <= taken <= most


def test_take_many_keeps_the_clock_reading_it_admitted_at() -> None:
    """The dispatch log stamps a step's tokens with this reading: another
    read of the clock, even a microsecond apart, can make a window between
    stamps look shorter than the limiter's (a 100 tok/s user read 0.3 µs
    over the bound that way)."""
    clock = FakeClock(5 * NS_PER_SECOND)
    limiter = OutputRateLimiter(10.0, clock=clock)
    limiter.take_many({"a": 1})
    assert limiter.last_take_ns == 5 * NS_PER_SECOND
    clock.advance(7)
    limiter.take_many({"a": 1, "b": 2})
    assert limiter.last_take_ns == 5 * NS_PER_SECOND + 7
