"""Several of vLLM's real schedulers sharing one store, as DP ranks would.

Each scheduler is ours on vLLM's real Scheduler/AsyncScheduler and KV cache
manager (tests/harness/scheduler_sim.py), with a LeasedLimiter on the shared
fake clock and its refresher's rounds run between steps against a real
redis-server. This is how data-parallel ranks share limits (each rank's
scheduler leases from the store); vLLM's CPU build does not run DP > 1.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from harness.bounds import assert_window_bound
from harness.counting_limiter import CountingLimiter
from harness.scheduler_sim import FakeClock, SchedulerHarness, make_scheduler
from vllm_output_rate.store.leases import LeasedLimiter
from vllm_output_rate.store.redis_store import RedisLeaseStore
from vllm_output_rate.store.refresher import Refresher
from vllm_output_rate.store.settings import StoreSettings

MS = 1_000_000
S = 1_000_000_000
LIMIT = 100.0


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
    for step in range(1200):  # 12 s of 10 ms steps
        clock.advance(10 * MS)
        if step % 10 == 0:
            for _, _, refresher in ranks:
                refresher.run_once(now_us=clock.now_ns // 1000)
        for harness, _, _ in ranks:
            harness.step()
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
