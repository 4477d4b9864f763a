"""Several of vLLM's real schedulers sharing one store, as DP ranks would.

Each scheduler is ours on vLLM's real Scheduler/AsyncScheduler and KV cache
manager (tests/harness/scheduler_sim.py), with a LeasedLimiter on the shared
fake clock and its refresher's rounds run between steps against a real
redis-server. This is how data-parallel ranks share limits (each rank's
scheduler leases from the store); vLLM's CPU build does not run DP > 1.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest

from harness.bounds import assert_window_bound
from harness.counting_limiter import CountingLimiter
from harness.redis_server import RedisServer
from harness.scheduler_sim import FakeClock, SchedulerHarness, make_scheduler
from vllm_output_rate.store.engine import prompt_store_settings, team_store_settings
from vllm_output_rate.store.leases import LeasedLimiter
from vllm_output_rate.store.redis_store import RedisLeaseStore
from vllm_output_rate.store.refresher import Refresher
from vllm_output_rate.store.settings import StoreSettings
from vllm_output_rate.team_budget import TeamBudget
from vllm_output_rate.teams import Teams

MS = 1_000_000
S = 1_000_000_000
LIMIT = 100.0
PROMPT_LIMIT = 2_000.0  # prompt tokens computed per second
FAR = 1e6  # an output rate that never binds


def leased_scheduler(
    model: str, url: str, prefix: str, clock: FakeClock, is_async: bool
):
    harness = make_scheduler(
        model,
        limits={"default_user_output_tokens_per_second": LIMIT},
        is_async=is_async,
        clock=clock,
        max_num_seqs=16,
    )
    settings = StoreSettings(url=url, key_prefix=prefix)
    limiter = LeasedLimiter(LIMIT, {}, settings, clock=clock)
    limiter.pacer = CountingLimiter(LIMIT, clock=clock)
    harness.scheduler.output_rate.use_limiter(limiter)
    refresher = Refresher(limiter, RedisLeaseStore(settings), f"rank-{id(harness)}")
    return harness, limiter, refresher


def sampled(harness: SchedulerHarness, user: str, since_ns: int) -> int:
    return sum(t >= since_ns for t in harness.sampled_at(user))


def run_ranks(ranks, clock: FakeClock, steps: int) -> None:
    """10 ms steps of every rank, each refresher's round every 10 steps."""
    for step in range(steps):
        clock.advance(10 * MS)
        if step % 10 == 0:
            for _, _, refresher in ranks:
                refresher.run_once(now_us=clock.now_ns // 1000)
        for harness, _, _ in ranks:
            harness.step()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_two_ranks_share_one_users_limit_3_to_1(
    tiny_model_path, redis_server, store_prefix, is_async
) -> None:
    clock = FakeClock(1_000 * S)
    ranks = [
        leased_scheduler(
            tiny_model_path, redis_server.url, store_prefix, clock, is_async
        )
        for _ in range(2)
    ]
    (a, _, _), (b, _, _) = ranks
    for _ in range(3):
        a.add("u", max_tokens=5000)
    b.add("u", max_tokens=5000)
    b.add("light", max_tokens=5000)  # another user, on one rank only
    run_ranks(ranks, clock, 1200)  # 12 s
    since = clock.now_ns - 10 * S
    got_a, got_b = sampled(a, "u", since), sampled(b, "u", since)
    assert 0.98 * LIMIT * 10 <= got_a + got_b <= LIMIT * 10 + 2
    assert got_a / got_b == pytest.approx(3, rel=0.05)
    assert sampled(b, "light", since) >= 0.98 * LIMIT * 10  # its own full limit
    assert_window_bound(sorted(a.sampled_at("u") + b.sampled_at("u")), LIMIT, engines=2)
    for harness, limiter, refresher in ranks:
        harness.drain()
        dispatched = Counter(d.user for d in harness.dispatches if d.samples)
        assert +limiter.pacer.net == +dispatched  # charged == dispatched
        refresher.store.close()


def prompt_leased_scheduler(
    model: str, url: str, prefix: str, clock: FakeClock, is_async: bool
):
    """A rank whose prompt-token budget is leased from the store (under its
    own keys, as the scheduler does with a store and prompt rates)."""
    harness = make_scheduler(
        model,
        limits={
            "default_user_output_tokens_per_second": FAR,
            "default_user_prompt_tokens_per_second": PROMPT_LIMIT,
        },
        is_async=is_async,
        clock=clock,
        max_num_batched_tokens=512,
    )
    settings = prompt_store_settings(StoreSettings(url=url, key_prefix=prefix))
    limiter = LeasedLimiter(PROMPT_LIMIT, {}, settings, clock=clock, lend_unused=False)
    limiter.pacer = CountingLimiter(PROMPT_LIMIT, clock=clock)
    harness.scheduler.output_rate.use_prompt_limiter(limiter)
    refresher = Refresher(limiter, RedisLeaseStore(settings), f"rank-{id(harness)}")
    return harness, limiter, refresher


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_two_ranks_share_one_users_prompt_limit(
    tiny_model_path, redis_server, store_prefix, is_async
) -> None:
    clock = FakeClock(1_000 * S)
    ranks = [
        prompt_leased_scheduler(
            tiny_model_path, redis_server.url, store_prefix, clock, is_async
        )
        for _ in range(2)
    ]
    (a, _, _), (b, _, _) = ranks
    # ~7,200 prompt tokens of hog's on the two ranks: ~3.6 s at its limit.
    for _ in range(6):
        a.add("hog", prompt_len=900, max_tokens=2)
    for _ in range(2):
        b.add("hog", prompt_len=900, max_tokens=2)
    b.add("light", prompt_len=900, max_tokens=2)  # its own limit, one rank
    run_ranks(ranks, clock, 600)  # 6 s
    hog = sorted(a.prompt_token_times("hog") + b.prompt_token_times("hog"))
    assert len(hog) == 8 * 899  # every prompt computed, none cut
    assert_window_bound(hog, PROMPT_LIMIT, engines=2)
    # Both ranks together at about the one limit, not twice it.
    took_s = (hog[-1] - hog[0]) / S
    # (Slower by the store's lag: a rank's new share waits until the share
    # another rank gave up is no longer counted, a grace of ~0.45 s.)
    assert len(hog) / PROMPT_LIMIT - 0.2 <= took_s <= len(hog) / PROMPT_LIMIT + 0.8
    # light, on one rank only, had its whole limit: done in ~0.45 s.
    light = b.prompt_token_times("light")
    assert len(light) == 899
    assert (light[-1] - light[0]) / S <= 899 / PROMPT_LIMIT + 0.2
    for harness, limiter, refresher in ranks:
        harness.drain()
        computed = Counter()
        for user in ("hog", "light"):
            computed[user] = len(harness.prompt_token_times(user))
        assert +limiter.pacer.net == +computed  # charged == computed
        refresher.store.close()


def test_our_scheduler_starts_and_stops_its_refresher(
    tiny_model_path, redis_server, store_prefix
) -> None:
    """With store_url in the settings, the scheduler leases by itself (real
    clock, real thread) and shutdown() stops the thread."""
    harness = make_scheduler(
        tiny_model_path,
        limits={
            "default_user_output_tokens_per_second": 40.0,
            "store_url": redis_server.url,
            "store_key_prefix": store_prefix,
        },
    )
    policy = harness.scheduler.output_rate
    assert isinstance(policy.limiter, LeasedLimiter)
    harness.add("u", max_tokens=1000)
    assert policy.on_close  # the refresher's stop
    deadline = time.monotonic() + 5
    while policy.limiter.lease_rate("u") is None and time.monotonic() < deadline:
        harness.step()
        time.sleep(0.01)
    assert policy.limiter.lease_rate("u") == 40.0
    assert policy.metrics_snapshot()["store"]["leases"] == 1
    assert policy.users_snapshot(10)["store"]["leases"] == 1
    harness.scheduler.shutdown()
    assert not policy.on_close


def test_with_prompt_rates_the_scheduler_leases_both_budgets(
    tiny_model_path, redis_server, store_prefix
) -> None:
    """Prompt rates and a store: the prompt budget is leased too, under its
    own keys, reported apart, and shutdown() stops both refreshers."""
    harness = make_scheduler(
        tiny_model_path,
        limits={
            "default_user_output_tokens_per_second": 40.0,
            "default_user_prompt_tokens_per_second": 3_000.0,
            "store_url": redis_server.url,
            "store_key_prefix": store_prefix,
        },
    )
    policy = harness.scheduler.output_rate
    prompt = policy.prompt_limiter
    assert isinstance(policy.limiter, LeasedLimiter)
    assert isinstance(prompt, LeasedLimiter)
    assert prompt.settings.key_prefix == store_prefix + ":prompt"
    assert len(policy.on_close) == 2
    harness.add("u", prompt_len=600, max_tokens=1000)
    deadline = time.monotonic() + 5
    while prompt.lease_rate("u") is None and time.monotonic() < deadline:
        harness.step()
        time.sleep(0.01)
    assert prompt.lease_rate("u") == 3_000.0
    assert policy.limiter.lease_rate("u") == 40.0
    snapshot = policy.metrics_snapshot()
    assert snapshot["prompt_store"]["leases"] == 1
    assert snapshot["store"]["leases"] == 1
    # Each budget's limits under its own keys.
    client = RedisLeaseStore(prompt.settings)
    try:
        assert client.read_limits().default_rate == 3_000.0
    finally:
        client.close()
    harness.scheduler.shutdown()
    assert not policy.on_close


TEAM_LIMIT = 60.0  # tok/s for the members of one team together


def team_leased_scheduler(model: str, url: str, prefix: str, clock: FakeClock):
    """A rank whose teams' budget is leased from the store (under its own
    keys, keyed by team), as the scheduler does with a store and teams; the
    users' own limits far above demand, so that only the team binds."""
    harness = make_scheduler(
        model,
        limits={
            "default_user_output_tokens_per_second": FAR,
            "teams": {
                "t": {
                    "output_tokens_per_second": TEAM_LIMIT,
                    "members": ["a1", "a2", "b1"],
                }
            },
        },
        clock=clock,
        max_num_seqs=16,
    )
    policy = harness.scheduler.output_rate
    settings = team_store_settings(StoreSettings(url=url, key_prefix=prefix))
    leased: list[LeasedLimiter] = []

    def lease(teams: Teams) -> LeasedLimiter:
        leased.append(
            LeasedLimiter(
                min(teams.rates.values()),
                teams.rates,
                settings,
                clock=clock,
                members=teams.team_of,
            )
        )
        return leased[0]

    policy.lease_team_budget = lease
    policy.use_limiter(policy.limiter.users)  # the team budget, leased now
    (limiter,) = leased
    refresher = Refresher(limiter, RedisLeaseStore(settings), f"rank-{id(harness)}")
    return harness, limiter, refresher


def two_team_ranks(model: str, url: str, prefix: str):
    """Two ranks with the same team on one store, on one fake clock."""
    clock = FakeClock(1_000 * S)
    return clock, [team_leased_scheduler(model, url, prefix, clock) for _ in range(2)]


def test_two_ranks_share_one_teams_limit(
    tiny_model_path, redis_server, store_prefix
) -> None:
    """Members of one team on two ranks: the team's limit holds over both
    (one budget in the store, keyed by team), shared by their demand (3
    streams on one rank, 1 on the other), while a user in no team gets its
    own limit."""
    clock, ranks = two_team_ranks(tiny_model_path, redis_server.url, store_prefix)
    (a, _, _), (b, _, _) = ranks
    assert isinstance(a.scheduler.output_rate.limiter, TeamBudget)
    for user in ("a1", "a1", "a2"):
        a.add(user, max_tokens=5000)
    b.add("b1", max_tokens=5000)
    b.add("alone", max_tokens=5000)  # in no team: its own (far) limit
    run_ranks(ranks, clock, 1200)  # 12 s
    since = clock.now_ns - 10 * S
    members = ("a1", "a2", "b1")
    got_a = sum(sampled(a, user, since) for user in members)
    got_b = sum(sampled(b, user, since) for user in members)
    assert 0.95 * TEAM_LIMIT * 10 <= got_a + got_b <= TEAM_LIMIT * 10 + 2
    assert got_a / got_b == pytest.approx(3, rel=0.1)
    assert sampled(b, "alone", since) >= 1000  # a token every 10 ms step
    team_times = sorted(
        t for h in (a, b) for user in members for t in h.sampled_at(user)
    )
    assert_window_bound(team_times, TEAM_LIMIT, engines=2)
    snapshot = a.scheduler.output_rate.metrics_snapshot()
    assert snapshot["team_store"]["leases"] == 1
    for _, _, refresher in ranks:
        refresher.store.close()


def test_a_team_limit_changed_on_one_rank_reaches_the_other(
    tiny_model_path, redis_server, store_prefix
) -> None:
    clock, ranks = two_team_ranks(tiny_model_path, redis_server.url, store_prefix)
    (a, _, _), (b, _, _) = ranks
    a.add("a1", max_tokens=5000)
    b.add("b1", max_tokens=5000)
    run_ranks(ranks, clock, 100)
    policy = a.scheduler.output_rate
    teams = policy.teams
    policy.use_teams(dataclasses.replace(teams, rates={"t": 2 * TEAM_LIMIT}))
    run_ranks(ranks, clock, 300)
    other = b.scheduler.output_rate
    assert other.limiter.rate_of("b1") == 2 * TEAM_LIMIT
    assert other.metrics_snapshot()["teams"]["t"]["limit"] == 2 * TEAM_LIMIT
    since = clock.now_ns - 2 * S
    got = sum(sampled(h, u, since) for h, u in ((a, "a1"), (b, "b1")))
    assert 0.95 * 2 * TEAM_LIMIT * 2 <= got <= 2 * TEAM_LIMIT * 2 + 2
    # An admin change of another team on b writes that team only: it does
    # not write back the limit b was configured with for "t".
    new_team = {"output_tokens_per_second": 10.0, "members": ["b9"]}
    other.update_limits({"teams": {"t9": new_team}})
    run_ranks(ranks, clock, 300)
    assert policy.limiter.rate_of("a1") == 2 * TEAM_LIMIT
    assert other.limiter.rate_of("b1") == 2 * TEAM_LIMIT
    # The new team and its member reached a too.
    assert policy.limiter.rate_of("b9") == other.limiter.rate_of("b9") == 10.0
    limits = other.limits_page(None)["limits"]["teams"]
    assert limits["t"]["output_tokens_per_second"] == 2 * TEAM_LIMIT
    for _, _, refresher in ranks:
        refresher.store.close()


def test_with_teams_the_scheduler_leases_the_teams_budget(
    tiny_model_path, redis_server, store_prefix
) -> None:
    """Teams and a store: the teams' budget is leased under its own keys,
    keyed by team, reported apart, and shutdown() stops its refresher."""
    harness = make_scheduler(
        tiny_model_path,
        limits={
            "default_user_output_tokens_per_second": 40.0,
            "store_url": redis_server.url,
            "store_key_prefix": store_prefix,
            "teams": {"t": {"output_tokens_per_second": 30.0, "members": ["u"]}},
        },
    )
    policy = harness.scheduler.output_rate
    limiter = policy.limiter
    assert isinstance(limiter, TeamBudget)
    assert isinstance(limiter.users, LeasedLimiter)
    assert isinstance(limiter.teams, LeasedLimiter)
    assert limiter.teams.settings.key_prefix == store_prefix + ":team"
    assert len(policy.on_close) == 2
    harness.add("u", max_tokens=1000)
    deadline = time.monotonic() + 5
    while limiter.teams.lease_rate("t") is None and time.monotonic() < deadline:
        harness.step()
        time.sleep(0.01)
    assert limiter.teams.lease_rate("t") == 30.0
    assert limiter.rate_of("u") == 30.0
    assert policy.users_snapshot(10)["team_store"]["leases"] == 1
    client = RedisLeaseStore(limiter.teams.settings)
    try:
        assert client.read_limits().user_rates == {"t": 30.0}
    finally:
        client.close()
    harness.scheduler.shutdown()
    assert not policy.on_close


def test_members_changed_on_one_rank_reach_the_other(
    tiny_model_path, redis_server, store_prefix
) -> None:
    """Membership is in the store beside the teams' limits: a member added
    on one rank is charged to its team on the other, a member removed there
    is not, and the limits route of the other shows the members."""
    clock, ranks = two_team_ranks(tiny_model_path, redis_server.url, store_prefix)
    (a, _, _), (b, _, _) = ranks
    a.add("a1", max_tokens=5000)
    b.add("b2", max_tokens=5000)
    run_ranks(ranks, clock, 100)
    other = b.scheduler.output_rate
    assert other.limiter.rate_of("b2") == FAR  # in no team yet
    members = ["a1", "b1", "b2"]  # a2 leaves, b2 joins
    team = {"output_tokens_per_second": TEAM_LIMIT, "members": members}
    a.scheduler.output_rate.update_limits({"teams": {"t": team}})
    run_ranks(ranks, clock, 300)
    assert other.limiter.rate_of("b2") == TEAM_LIMIT
    assert other.limiter.rate_of("a2") == FAR
    limits = other.limits_page(None)["limits"]["teams"]
    assert limits["t"]["members"] == members
    # b2 is charged to the team on b: a1 and b2 share its limit.
    since = clock.now_ns - 2 * S
    got = sampled(a, "a1", since) + sampled(b, "b2", since)
    assert 0.9 * TEAM_LIMIT * 2 <= got <= TEAM_LIMIT * 2 + 2
    for _, _, refresher in ranks:
        refresher.store.close()


def test_a_shared_user_is_not_paused_when_a_restarted_store_answers(
    tiny_model_path, store_prefix
) -> None:
    """The store dies and comes back empty. It grants the first engine to
    ask a user's whole limit, while that engine keeps the user at its
    fallback share for a lease period (resume.py): asking for no more than
    that share, it leaves the rest to the other engine at once, so the user
    is never paused on either, and the bound holds over both."""
    with RedisServer() as server:
        clock = FakeClock(1_000 * S)
        ranks = [
            leased_scheduler(tiny_model_path, server.url, store_prefix, clock, False)
            for _ in range(2)
        ]
        (a, _, _), (b, _, _) = ranks
        for _ in range(3):
            a.add("u", max_tokens=100_000)
        b.add("u", max_tokens=100_000)
        run_ranks(ranks, clock, 300)
        server.kill()
        run_ranks(ranks, clock, 500)  # past a lease period: fallback shares
        server.start()
        up = clock.now_ns
        run_ranks(ranks, clock, 400)
        for harness in (a, b):
            for half in range(8):  # 4 s after the store came back
                since = up + half * S // 2
                got = sampled(harness, "u", since) - sampled(
                    harness, "u", since + S // 2
                )
                # At least b's share (1/4 of the limit) on each, every half
                # second: 12 or 13 tokens.
                assert got >= 0.9 * LIMIT / 4 / 2, (half, got)
        both = sorted(a.sampled_at("u") + b.sampled_at("u"))
        assert_window_bound(both, LIMIT, engines=2)
        for _, _, refresher in ranks:
            refresher.store.close()
