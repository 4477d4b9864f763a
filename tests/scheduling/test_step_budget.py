"""StepBudget on its own: one step's reservations, spending and the refund.

The scheduler tests exercise it through vLLM's scheduler; these pin its
contract directly, against the real limiter and a fake clock.
"""

from __future__ import annotations

from harness.counting_limiter import CountingLimiter
from harness.fake_clock import FakeClock
from vllm_output_rate.scheduling.step_budget import StepBudget

MS = 1_000_000


def budget(default: float = 10, users: dict[str, float] | None = None, cap: int = 64):
    """A function that reserves one step's budget for a demand, its limiter
    and its clock."""
    clock = FakeClock(1_000 * MS)
    limiter = CountingLimiter(default, users, clock=clock)

    def reserve(demand: dict[str, int]) -> StepBudget:
        return StepBudget(limiter, demand, cap)

    return reserve, limiter, clock


def test_a_whole_reservation_means_nobody_can_be_refused() -> None:
    reserve, limiter, _ = budget(default=1000)
    step = reserve({"a": 3, "b": 1})
    assert step.covers_demand
    assert step.has_budget("a") and step.has_budget("b")
    assert not step.refused_users
    assert step.settle({}) is None
    assert +limiter.net == {}  # nothing spent: everything went back


def test_a_partial_reservation_is_spent_then_refused() -> None:
    reserve, limiter, _ = budget(default=10)  # burst: 2 tokens at 10 tok/s
    step = reserve({"a": 5})
    assert not step.covers_demand
    assert step.spend("a") and step.spend("a")
    assert not step.spend("a")
    assert step.refused_users == {"a"}
    ready = step.settle({})
    assert ready == limiter.ready_at_ns("a") > limiter.now_ns()
    assert limiter.net["a"] == 2


def test_undispatched_tokens_go_back_at_settle() -> None:
    reserve, limiter, _ = budget(default=10)
    step = reserve({"a": 2})
    step.spend("a")
    step.spend("a")
    step.settle({"a": 1})  # one of the two was not dispatched after all
    assert limiter.net["a"] == 1


def test_a_refund_never_exceeds_what_was_reserved() -> None:
    reserve, limiter, _ = budget(default=10)
    step = reserve({"a": 1})
    step.spend("a")
    step.settle({"a": 5})  # a caller's miscount cannot mint budget
    assert limiter.net["a"] == 0


def test_demand_is_capped_by_the_requests_one_step_can_schedule() -> None:
    reserve, limiter, _ = budget(default=1e9, cap=4)
    # 10 unfinished requests, but a step schedules at most 4: 4 is whole.
    step = reserve({"a": 10})
    assert step.covers_demand
    assert limiter.net["a"] == 4


def test_a_user_missing_from_the_demand_is_asked_when_it_appears() -> None:
    reserve, limiter, _ = budget(default=10)
    step = reserve({"a": 1})
    assert step.has_budget("late")
    assert limiter.user_calls["late"] == 1
    step.settle({})
    assert limiter.net["late"] == 0


def test_spend_counts_in_the_steady_state_is_one_comparison() -> None:
    reserve, limiter, _ = budget(default=1000)
    step = reserve({"a": 2, "b": 1})
    assert step.spend_counts({"a": 2, "b": 1})
    step.settle({})
    assert +limiter.net == {"a": 2, "b": 1}


def test_spend_counts_takes_an_excess_after_the_fact() -> None:
    reserve, limiter, _ = budget(default=1000)
    step = reserve({"a": 1})
    assert not step.spend_counts({"a": 3})  # more than reserved: reported
    step.settle({})
    assert limiter.net["a"] == 3  # and charged, as far as the limiter allows


def test_a_refused_user_is_not_asked_again_in_the_step() -> None:
    reserve, limiter, _ = budget(default=10, users={"slow": 0.001})
    step = reserve({"slow": 3})
    calls = limiter.user_calls["slow"]
    for _ in range(5):
        step.has_budget("slow")
    assert limiter.user_calls["slow"] == calls


def test_settle_gives_everything_back_in_one_limiter_call() -> None:
    reserve, limiter, _ = budget(default=1000)
    step = reserve({"a": 3, "b": 2, "c": 1})
    assert step.spend("a") and step.spend("b") and step.spend("c")
    step.settle({"c": 1})  # c's token was not dispatched after all
    assert limiter.calls["refund_many"] == 1 and limiter.calls["refund"] == 0
    assert +limiter.net == {"a": 1, "b": 1}
