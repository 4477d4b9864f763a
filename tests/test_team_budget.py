"""``TeamBudget`` on its own, driven by a fake clock: whatever the members
want and give back, each member's tokens keep its own bound and the team's
keep the team's, and members of a team that wants more than its limit take
turns."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bounds import assert_window_bound
from harness.fake_clock import FakeClock
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.team_budget import TeamBudget
from vllm_output_rate.teams import Teams

MS = 1_000_000
RATES = st.sampled_from([0.5, 2.5, 10, 33.3, 100, 1234.5])
MEMBERS = ("a", "b", "c")


def budget(clock: FakeClock, team_rate: float, member_rates: dict[str, float]):
    users = OutputRateLimiter(1_000.0, member_rates, clock=clock)
    teams = Teams({"t": team_rate}, {"a": "t", "b": "t", "c": "t"})
    return TeamBudget(users, teams)


@settings(max_examples=60, deadline=None)
@given(
    team_rate=RATES,
    member_rates=st.fixed_dictionaries({user: RATES for user in MEMBERS}),
    steps=st.lists(
        st.tuples(
            st.integers(1, 40),  # ms since the last step
            st.fixed_dictionaries(
                {user: st.integers(0, 6) for user in (*MEMBERS, "x")}
            ),
            st.integers(0, 3),  # tokens each user gives back of what it got
        ),
        min_size=1,
        max_size=300,
    ),
)
def test_every_bound_holds_whatever_the_demand(team_rate, member_rates, steps) -> None:
    clock = FakeClock(10**12)
    limits = budget(clock, team_rate, member_rates)
    kept: dict[str, list[int]] = {user: [] for user in (*MEMBERS, "x")}
    for advance_ms, wanted, give_back in steps:
        clock.advance(advance_ms * MS)
        got = limits.take_many(wanted)
        assert all(0 <= got[user] <= wanted[user] for user in wanted)
        refunds = {user: min(give_back, count) for user, count in got.items()}
        limits.refund_many(refunds)
        for user, count in got.items():
            kept[user] += [clock.now_ns] * (count - refunds[user])
    team = sorted(t for user in MEMBERS for t in kept[user])
    assert_window_bound(team, team_rate)
    for user in MEMBERS:
        assert_window_bound(kept[user], member_rates[user])
    assert_window_bound(kept["x"], 1_000.0)  # in no team


def test_members_of_a_short_team_take_turns() -> None:
    clock = FakeClock(10**12)
    limits = budget(clock, 10.0, {})
    received: Counter[str] = Counter()
    for _ in range(1_000):  # 10 s of 10 ms steps, each member wanting 2
        clock.advance(10 * MS)
        got = limits.take_many(dict.fromkeys(MEMBERS, 2))
        received.update(got)
    assert sum(received.values()) <= 10 * 10.1 + 1
    assert max(received.values()) - min(received.values()) <= 1


def test_a_member_back_from_a_pause_is_not_owed_every_turn() -> None:
    clock = FakeClock(10**12)
    limits = budget(clock, 10.0, {})
    for _ in range(500):  # 5 s: a alone
        clock.advance(10 * MS)
        limits.take_many({"a": 1})
    received: Counter[str] = Counter()
    for _ in range(500):  # 5 s: a and b
        clock.advance(10 * MS)
        received.update(limits.take_many({"a": 1, "b": 1}))
    # b does not get the next 50 tokens alone: they alternate at once.
    assert abs(received["a"] - received["b"]) <= 3


@settings(max_examples=100, deadline=None)
@given(
    team_of=st.dictionaries(
        st.sampled_from([f"u{i}" for i in range(40)]), st.sampled_from("pqr")
    ),
    got=st.dictionaries(
        st.sampled_from([f"u{i}" for i in range(50)]), st.integers(0, 4)
    ),
)
def test_a_teams_tokens_are_its_members_whichever_way_they_are_summed(
    team_of, got
) -> None:
    """``_per_team`` sums per member when few members took part and per team
    when most did: both give each team its members' tokens."""
    teams = Teams({team: 10.0 for team in set(team_of.values())}, team_of)
    limits = TeamBudget(OutputRateLimiter(1.0, clock=FakeClock(0)), teams)
    expected: Counter[str] = Counter()
    for user, count in got.items():
        if user in team_of and count:
            expected[team_of[user]] += count
    assert limits._per_team(got) == dict(expected)
