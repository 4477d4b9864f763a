"""Teams changed live, as the admin API does (``update_limits``,
``limits_page``), on vLLM's real scheduler with a fake clock: a team given
binds from the next step, is replaced whole, and is dropped by
``remove_teams``; a change that would put a user in two teams, drop an
unknown team or promise members more than their team's limit is refused
whole."""

from __future__ import annotations

import pytest

from harness.bounds import MS, S, assert_window_bound
from vllm_output_rate.team_budget import TeamBudget
from vllm_output_rate.validation import OutputRateConfigError

STEP_NS = 10 * MS


def team(rate: float, *members: str) -> dict[str, object]:
    return {"output_tokens_per_second": rate, "members": list(members)}


def steps(h, seconds: float) -> None:
    for _ in range(round(seconds * S / STEP_NS)):
        h.step(STEP_NS)


def test_a_team_given_live_binds_from_the_next_step(limited) -> None:
    h = limited(100.0)
    policy = h.scheduler.output_rate
    for user in ("a", "b"):
        h.add(user, max_tokens=10_000)
    steps(h, 1)
    changed_at = h.clock.now_ns
    policy.update_limits({"teams": {"t": team(40.0, "a", "b")}})
    assert isinstance(policy.limiter, TeamBudget)
    assert policy.limits()["teams"] == {"t": team(40.0, "a", "b")}
    steps(h, 5)
    after = sorted(t for u in ("a", "b") for t in h.sampled_at(u) if t > changed_at)
    assert_window_bound(after, 40.0)
    assert len(after) >= 0.97 * 40 * 5

    # Replaced whole: b leaves the team and gets its own 100 again.
    policy.update_limits({"teams": {"t": team(40.0, "a")}})
    replaced_at = h.clock.now_ns
    steps(h, 3)
    b = [t for t in h.sampled_at("b") if t > replaced_at]
    a = [t for t in h.sampled_at("a") if t > replaced_at]
    assert len(b) >= 0.97 * 100 * 3
    assert_window_bound(a, 40.0)

    # Dropped: a is back at its own limit.
    policy.update_limits({"remove_teams": ["t"]})
    assert policy.limits()["teams"] == {}
    dropped_at = h.clock.now_ns
    steps(h, 2)
    assert len([t for t in h.sampled_at("a") if t > dropped_at]) >= 0.97 * 100 * 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teams": {"y": team(10.0, "a")}}, "already a member of team 'x'"),
        ({"remove_teams": ["nope"]}, "unknown team 'nope'"),
        (
            {"user_min_output_tokens_per_second": {"a": 30, "b": 30}},
            "above the team's limit",
        ),
        (
            {
                "teams": {"x": team(10.0, "a", "b")},
                "user_output_tokens_per_second": {"z": 5},
            },
            None,
        ),
    ],
)
def test_a_bad_team_change_is_refused_whole(limited, change, message) -> None:
    h = limited(100.0, teams={"x": team(50.0, "a", "b")})
    policy = h.scheduler.output_rate
    before = policy.limits()
    if message is None:  # a good one, for contrast: all of it applies
        policy.update_limits(change)
        assert policy.limits()["teams"]["x"]["output_tokens_per_second"] == 10.0
        assert policy.limits()["user_output_tokens_per_second"] == {"z": 5.0}
        return
    with pytest.raises(OutputRateConfigError, match=message):
        policy.update_limits(change)
    assert policy.limits() == before
