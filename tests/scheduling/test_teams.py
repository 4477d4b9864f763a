"""Teams over users (``team_budget.py``) on vLLM's real scheduler, sync and
async, with a fake clock: the team's bound over its members together, each
member's own bound, turns within a team, users in no team left alone, and
the accounting invariant for users and teams (checked by ``limited``)."""

from __future__ import annotations

import pytest

from harness.bounds import MS, S, assert_window_bound
from vllm_output_rate.team_budget import TeamBudget

STEP_NS = 10 * MS
FAR_LIMIT = 100_000.0
SECONDS = 10


def team(rate: float, *members: str) -> dict[str, object]:
    return {"output_tokens_per_second": rate, "members": list(members)}


def run(h, seconds: float = SECONDS) -> None:
    for _ in range(round(seconds * S / STEP_NS)):
        h.step(STEP_NS)


def test_four_members_share_their_teams_limit(limited) -> None:
    # Each member's own limit (100) is the team's: only the team binds.
    members = ("a", "b", "c", "d")
    h = limited(100.0, teams={"research": team(100.0, *members)})
    assert isinstance(h.scheduler.output_rate.limiter, TeamBudget)
    for user in members:
        for _ in range(2):
            h.add(user, max_tokens=10_000)
    run(h)
    together = sorted(t for user in members for t in h.sampled_at(user))
    assert_window_bound(together, 100.0)
    assert 0.98 * 100 * SECONDS <= len(together) <= 100 * SECONDS + 11
    # Turns: each member about a quarter of it.
    for user in members:
        assert len(h.sampled_at(user)) == pytest.approx(25 * SECONDS, rel=0.05)
    # What operators read: the team's tokens, limit and members.
    h.drain()
    policy = h.scheduler.output_rate
    team_view = policy.metrics_snapshot()["teams"]["research"]
    dispatched = sum(len(h.sampled_at(user)) for user in members)
    assert team_view == {"limit": 100.0, "members": 4, "tokens": dispatched}
    page = policy.users_snapshot(10)
    assert page["teams"]["research"]["tokens"] == dispatched
    assert {page["users"][user]["team"] for user in members} == {"research"}


def test_a_member_is_held_to_its_own_limit_too(limited) -> None:
    # The team allows 100; slow's own limit is 10, so fast gets the rest.
    h = limited(1_000.0, {"slow": 10.0}, teams={"t": team(100.0, "slow", "fast")})
    for user in ("slow", "fast"):
        for _ in range(3):
            h.add(user, max_tokens=10_000)
    run(h)
    slow, fast = h.sampled_at("slow"), h.sampled_at("fast")
    assert_window_bound(slow, 10.0)
    assert_window_bound(sorted(slow + fast), 100.0)
    assert len(slow) >= 0.98 * 10 * SECONDS
    assert len(fast) >= 0.97 * 90 * SECONDS


def test_users_in_no_team_keep_their_own_limit(limited) -> None:
    h = limited(50.0, teams={"t": team(20.0, "member")})
    h.add("member", max_tokens=10_000)
    h.add("member", max_tokens=10_000)
    h.add("loner", max_tokens=10_000)
    run(h)
    assert_window_bound(h.sampled_at("member"), 20.0)
    assert len(h.sampled_at("member")) >= 0.98 * 20 * SECONDS
    assert len(h.sampled_at("loner")) >= 0.98 * 50 * SECONDS


def test_two_teams_are_apart(limited) -> None:
    h = limited(
        1_000.0, teams={"x": team(30.0, "x1", "x2"), "y": team(60.0, "y1", "y2")}
    )
    for user in ("x1", "x2", "y1", "y2"):
        h.add(user, max_tokens=10_000)
    run(h)
    x = sorted(h.sampled_at("x1") + h.sampled_at("x2"))
    y = sorted(h.sampled_at("y1") + h.sampled_at("y2"))
    assert_window_bound(x, 30.0)
    assert_window_bound(y, 60.0)
    assert len(x) >= 0.98 * 30 * SECONDS
    assert len(y) >= 0.98 * 60 * SECONDS


def test_without_teams_the_budget_is_the_users_alone(limited) -> None:
    h = limited(100.0)
    assert not isinstance(h.scheduler.output_rate.limiter, TeamBudget)


def saturated(limited, teams, streams: dict[str, int], *, shortcuts: bool = True):
    """Every user far below its limit, 4 active slots for all the streams:
    who gets a slot is the fair shares' call alone."""
    h = limited(
        100_000.0,
        teams=teams,
        shortcuts=shortcuts,
        max_num_active_seqs=4,
        max_num_seqs=sum(streams.values()),
    )
    for user, count in streams.items():
        for _ in range(count):
            h.add(user, max_tokens=100_000)
    for _ in range(100):
        h.step(STEP_NS)
    start = len(h.dispatches)
    for _ in range(400):
        h.step(STEP_NS)
    got: dict[str, int] = {}
    for d in h.dispatches[start:]:
        if d.samples:
            got[d.user] = got.get(d.user, 0) + 1
    return got


@pytest.mark.parametrize("shortcuts", [True, False], ids=["shortcuts", "reference"])
def test_a_full_engine_shares_between_teams_then_within_them(
    limited, shortcuts
) -> None:
    """Fair shares are hierarchical: a team of four and a user in no team
    get half of a full engine each (by users alone the four would get four
    fifths), and the four share their team's half evenly."""
    members = ("m1", "m2", "m3", "m4")
    got = saturated(
        limited,
        {"big": team(100_000.0, *members)},
        {"solo": 4, **dict.fromkeys(members, 4)},
        shortcuts=shortcuts,
    )
    total = sum(got.values())  # 4 slots x 400 steps
    team_tokens = sum(got[m] for m in members)
    assert got["solo"] == pytest.approx(total / 2, rel=0.05)
    assert team_tokens == pytest.approx(total / 2, rel=0.05)
    for member in members:
        assert got[member] == pytest.approx(team_tokens / 4, rel=0.1)


def test_team_weights_divide_a_full_engine(limited) -> None:
    """Teams weigh as users do: a team at weight 3 gets three quarters
    beside a team at weight 1, whatever their sizes."""
    heavy = {**team(100_000.0, "h1"), "weight": 3.0}
    light = team(100_000.0, "l1", "l2", "l3")
    got = saturated(
        limited,
        {"heavy": heavy, "light": light},
        {"h1": 4, "l1": 4, "l2": 4, "l3": 4},
    )
    total = sum(got.values())
    assert got["h1"] == pytest.approx(0.75 * total, rel=0.05)


def test_a_teams_weight_is_read_and_changed_with_the_team(limited) -> None:
    h = limited(100.0, teams={"t": {**team(50.0, "a", "b"), "weight": 2.0}})
    policy = h.scheduler.output_rate
    h.add("a", max_tokens=100)
    h.add("b", max_tokens=100)
    h.step(STEP_NS)
    assert policy.fair.weight("a") == policy.fair.weight("b") == 1.0  # 2 / 2
    page = policy.limits_page(None)["limits"]["teams"]
    assert page["t"] == {"output_tokens_per_second": 50.0, "members": ["a", "b"],
                         "weight": 2.0}  # fmt: skip
    policy.update_limits({"teams": {"t": team(50.0, "a", "b")}})  # weight 1
    h.step(STEP_NS)
    assert policy.fair.weight("a") == 0.5
    assert "weight" not in policy.limits_page(None)["limits"]["teams"]["t"]
    assert policy.fair.weights == {}  # as configured: no user weights


@pytest.mark.parametrize("shortcuts", [True, False], ids=["shortcuts", "reference"])
def test_a_teams_floor_holds_for_its_members_together(limited, shortcuts) -> None:
    """A hog weighing 20 saturates a full engine (4 slots, 400 tok/s); a
    team of two with a 60 tok/s floor gets it together (by weight alone, a
    fifteenth of the engine), split between them, and not much more."""
    small = {**team(100_000.0, "s1", "s2"), "min_output_tokens_per_second": 60.0}
    h = limited(
        FAR_LIMIT,
        weights={"hog": 20.0},
        teams={"small": small},
        shortcuts=shortcuts,
        max_num_seqs=36,
        max_num_active_seqs=4,
    )
    for _ in range(32):
        h.add("hog", max_tokens=100_000)
    for user in ("s1", "s2"):
        for _ in range(2):
            h.add(user, max_tokens=100_000)
    run(h, 1.0)
    start = len(h.dispatches)
    run(h, 3.0)
    got: dict[str, int] = {}
    for d in h.dispatches[start:]:
        if d.samples:
            got[d.user] = got.get(d.user, 0) + 1
    assert sum(got.values()) == 4 * 300  # the engine stays full
    together = got.get("s1", 0) + got.get("s2", 0)
    assert 60 * 3 - 6 <= together <= 60 * 3 + 6
    assert got["s1"] == pytest.approx(got["s2"], abs=8)
    fair = h.scheduler.output_rate.fair
    assert fair.ranked_floors == {"s1": 30.0, "s2": 30.0}
    assert fair.floors == {}  # as configured: no user floors


def test_a_change_of_one_team_keeps_the_others_weight_and_floor(limited) -> None:
    """The admin API replaces the teams it names whole; the others keep
    their weight and floor, on the limits route and in the ranking."""
    kept = {**team(50.0, "a"), "weight": 2.0, "min_output_tokens_per_second": 20.0}
    h = limited(100.0, teams={"kept": kept, "other": team(50.0, "b")})
    policy = h.scheduler.output_rate
    policy.update_limits({"teams": {"other": team(60.0, "b")}})
    page = policy.limits_page(None)["limits"]["teams"]
    assert page["kept"] == {**kept, "members": ["a"]}
    assert page["other"] == team(60.0, "b")
    h.add("a", max_tokens=100)
    h.step(STEP_NS)
    assert policy.fair.weight("a") == 2.0
    assert policy.fair.ranked_floors == {"a": 20.0}
