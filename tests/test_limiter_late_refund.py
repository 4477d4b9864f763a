"""``refund_late``: a step's refund that arrives after later steps took budget.

With speculative decoding a step is charged the most it can emit and the
tokens it did not emit are given back when its output is known: one step
later when synchronous, after further steps with asynchronous scheduling or
pipeline parallelism. The limiter must then end exactly where GCRA would
have, had each step taken only what it delivered, and what was delivered
must respect the bound ``(W + 0.1) x limit + 1``.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bounds import assert_bound
from harness.fake_clock import FakeClock
from vllm_output_rate.limiter import OutputRateLimiter

MS = 1_000_000
RATES = st.sampled_from([0.5, 2.5, 10, 33.3, 150, 1234.5])
STEP = st.tuples(
    st.integers(min_value=0, max_value=80),  # ms since the previous step
    st.integers(min_value=0, max_value=12),  # tokens wanted
    st.floats(min_value=0, max_value=1),  # share of the grant delivered
)


@settings(max_examples=300, deadline=None)
@given(
    rate=RATES,
    depth=st.integers(min_value=0, max_value=3),
    steps=st.lists(STEP, min_size=1, max_size=60),
)
def test_late_refunds_end_where_gcra_over_the_delivered_tokens_ends(
    rate: float, depth: int, steps: list[tuple[int, int, float]]
) -> None:
    clock = FakeClock(10**9)
    limiter = OutputRateLimiter(1, {"u": rate}, clock=clock)
    exact = OutputRateLimiter(1, {"u": rate}, clock=clock)
    granted: list[tuple[int, int, int]] = []  # (clock, granted, delivered)
    delivered_at: list[int] = []

    def refund(step: int) -> None:
        _, grant, delivered = granted[step]
        later = [(c, g) for c, g, _ in granted[step + 1 :] if g > 0]
        limiter.refund_late("u", grant - delivered, later)

    for index, (gap_ms, wanted, share) in enumerate(steps):
        clock.advance(gap_ms * MS)
        # The step `depth` + 1 back has reported its output by now.
        if index > depth:
            refund(index - depth - 1)
        grant = limiter.take_up_to("u", wanted)
        delivered = int(grant * share)
        granted.append((clock.now_ns, grant, delivered))
        # GCRA on what was delivered admits it all, at the same clock.
        assert exact.take_up_to("u", delivered) == delivered
        delivered_at += [clock.now_ns] * delivered
        assert limiter.ready_at_ns("u") >= exact.ready_at_ns("u")
    for step in range(max(0, len(steps) - depth - 1), len(steps)):
        refund(step)
    assert state(limiter, "u") == state(exact, "u")
    assert_bound(delivered_at, rate)


def state(limiter: OutputRateLimiter, user: str) -> int:
    """The user's TAT; one in the past is the same as none (now)."""
    now = limiter.now_ns() * limiter._overrides[user].scale
    return max(limiter._tat_of(user) or now, now)


def test_a_late_refund_never_moves_later_tokens_ahead_of_their_slots() -> None:
    # 10 tok/s: 100 ms a token. Step 1 takes 2 of which 1 is delivered;
    # step 2, 150 ms later and before step 1's refund, takes 1 more.
    clock = FakeClock(10**9)
    limiter = OutputRateLimiter(1, {"a": 10}, clock=clock)
    assert limiter.take_up_to("a", 2) == 2  # due times 1.0 s and 1.1 s
    clock.advance(150 * MS)
    assert limiter.take_up_to("a", 1) == 1  # due 1.2 s
    taken_at = clock.now_ns
    # A plain refund would put the next token's slot at 1.2 s, before step
    # 2's token, which was dispatched at 1.15 s and holds a slot from then
    # on: that token must keep the 1.15-1.25 s slot.
    limiter.refund_late("a", 1, [(taken_at, 1)])
    assert limiter._tat_of("a") == 1_250 * MS * 10  # scaled by the rate
    exact_clock = FakeClock(10**9)
    exact = OutputRateLimiter(1, {"a": 10}, clock=exact_clock)
    exact.take_up_to("a", 1)
    exact_clock.advance(150 * MS)
    exact.take_up_to("a", 1)
    assert state(limiter, "a") == state(exact, "a")
