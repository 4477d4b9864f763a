"""Fixtures of the scheduler-level tests.

Every test that uses ``limited`` runs for synchronous and asynchronous
scheduling, with a fake clock driving the limiter. After every test, the
accounting invariant is checked: for each user, the tokens the limiter holds
as spent equal the sampling steps the scheduler dispatched (charged at
dispatch, refunded when not dispatched, never charged twice).
"""

from __future__ import annotations

from collections import Counter

import pytest

from harness.counting_limiter import CountingLimiter
from harness.scheduler_sim import SchedulerHarness, make_scheduler


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def is_async(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
def limited(tiny_model_path: str, is_async: bool):
    """Factory for a limited scheduler; checks the accounting afterwards."""
    made: list[SchedulerHarness] = []

    def make(
        default: float,
        users: dict[str, float] | None = None,
        *,
        weights: dict[str, float] | None = None,
        floors: dict[str, float] | None = None,
        shortcuts: bool = True,
        fair_step_tokens: bool = True,
        **kwargs,
    ):
        limits: dict[str, object] = {"default_user_output_tokens_per_second": default}
        if not shortcuts:
            limits["shortcuts"] = False  # the reference step (shortcuts.py)
        if not fair_step_tokens:
            limits["fair_step_tokens"] = False  # vLLM sizes every chunk
        if users:
            limits["user_output_tokens_per_second"] = users
        if weights:
            limits["user_output_weight"] = weights
        if floors:
            limits["user_min_output_tokens_per_second"] = floors
        harness = make_scheduler(
            tiny_model_path, limits=limits, is_async=is_async, **kwargs
        )
        harness.scheduler.output_rate.use_limiter(
            CountingLimiter(default, users, clock=harness.clock)
        )
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.drain()
        limiter = harness.scheduler.output_rate.limiter
        dispatched = Counter(d.user for d in harness.dispatches if d.samples)
        assert +limiter.net == +dispatched
