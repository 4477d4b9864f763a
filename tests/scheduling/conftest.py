"""Fixtures of the scheduler-level tests.

Every test that uses ``limited`` runs for synchronous and asynchronous
scheduling, with a fake clock driving the limiter. After every test, the
accounting invariant is checked: for each user, the tokens the limiter holds
as spent equal the sampling steps the scheduler dispatched (charged at
dispatch, refunded when not dispatched, never charged twice), and with
prompt rates, the prompt limiter's equal the prompt tokens dispatched; with
teams, each team's equal its members' sampling steps.
"""

from __future__ import annotations

from collections import Counter

import pytest

from harness.counting_limiter import CountingLimiter
from harness.scheduler_sim import SchedulerHarness, make_scheduler
from vllm_output_rate.team_budget import TeamBudget


def prompt_tokens(harness: SchedulerHarness) -> Counter[str]:
    """Prompt tokens computed per user: every dispatched token but the one
    that samples."""
    counts: Counter[str] = Counter()
    for d in harness.dispatches:
        counts[d.user] += d.num_tokens - (1 + d.drafts if d.samples else 0)
    return counts


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
        prompt: dict[str, float] | None = None,
        teams: dict[str, dict[str, object]] | None = None,
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
        if prompt:
            # Prompt tokens per second: "default" and per-user rates.
            prompt_users = {u: r for u, r in prompt.items() if u != "default"}
            limits["default_user_prompt_tokens_per_second"] = prompt["default"]
            limits["user_prompt_tokens_per_second"] = prompt_users
        if teams:
            limits["teams"] = teams  # teams.py's format
        harness = make_scheduler(
            tiny_model_path, limits=limits, is_async=is_async, **kwargs
        )
        policy = harness.scheduler.output_rate
        policy.use_limiter(CountingLimiter(default, users, clock=harness.clock))
        if isinstance(policy.limiter, TeamBudget):
            team_rates = policy.limiter.team_rates
            policy.limiter.teams = CountingLimiter(1.0, team_rates, clock=harness.clock)
        if prompt:
            policy.prompt_limiter = CountingLimiter(
                prompt["default"], prompt_users, clock=harness.clock
            )
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.drain()
        limiter = harness.scheduler.output_rate.limiter
        dispatched = Counter(d.user for d in harness.dispatches if d.samples)
        if isinstance(limiter, TeamBudget) and isinstance(
            limiter.teams, CountingLimiter
        ):
            # A team is charged what its members were dispatched.
            by_team = Counter()
            for user, count in dispatched.items():
                if user in limiter.team_of:
                    by_team[limiter.team_of[user]] += count
            assert +limiter.teams.net == +by_team
        if isinstance(limiter, TeamBudget):
            limiter = limiter.users
        assert +limiter.net == +dispatched
        prompt_limiter = harness.scheduler.output_rate.prompt_limiter
        if prompt_limiter is not None:
            # Prompt tokens: charged what was computed, the rest given back.
            assert isinstance(prompt_limiter, CountingLimiter)
            assert +prompt_limiter.net == +prompt_tokens(harness)
