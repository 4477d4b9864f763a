"""Several engines sharing one user's limit through a real store (fake clock).

The global bound (docs/architecture.md, "The shared store"): in every window
of W seconds, at most ``(W + 0.1) x limit + N`` tokens over the N engines
holding a lease; and with demand above the limit, the limit in total, split
by demand.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.bounds import assert_window_bound
from harness.fake_clock import FakeClock
from harness.redis_server import RedisServer
from harness.store_sim import SimEngine, merged
from vllm_output_rate.exact_rate import NS_PER_SECOND
from vllm_output_rate.store.messages import StoreUnavailable
from vllm_output_rate.store.settings import StoreSettings

MS = 1_000_000
BURST_NS = 100 * MS


def assert_global_bound(times: list[int], rate: float, engines: int) -> None:
    assert_window_bound(times, rate, engines=engines)


def make_engines(url: str, prefix: str, count: int, limit: float, clock: FakeClock):
    settings_ = StoreSettings(url=url, key_prefix=prefix, lease_s=2.0, refresh_s=0.1)
    return [SimEngine.create(f"e{i}", settings_, clock, limit) for i in range(count)]


def run(engines, clock, seconds: float, step_ms: int = 10, refresh_ms: int = 100):
    for tick in range(round(seconds * 1000 / step_ms)):
        clock.advance(step_ms * MS)
        if tick % (refresh_ms // step_ms) == 0:
            for engine in engines:
                engine.refresh()
        for engine in engines:
            engine.step()


def delivered(engines, user: str, start_ns: int, end_ns: int) -> list[int]:
    return [
        sum(start_ns <= t < end_ns for t in e.dispatched.get(user, [])) for e in engines
    ]


def test_demand_split_3_to_1_gets_the_limit_split_3_to_1(redis_server, store_prefix):
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 100.0, clock)
    engines[0].set_demand("u", 3)
    engines[1].set_demand("u", 1)
    run(engines, clock, 12)
    start = clock.now_ns - 10 * NS_PER_SECOND
    a, b = delivered(engines, "u", start, clock.now_ns)
    assert 0.98 * 1000 <= a + b <= 1000 + 2, (a, b)
    assert a / b == pytest.approx(3, rel=0.05), (a, b)
    assert_global_bound(merged(engines, "u"), 100.0, 2)
    assert engines[0].limiter.lease_rate("u") == 75.0


def test_one_engine_dies_the_other_gets_the_whole_limit_within_a_lease(
    redis_server, store_prefix
):
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 50.0, clock)
    for engine in engines:
        engine.set_demand("u", 2)
    run(engines, clock, 3)
    engines[0].alive = False  # no more steps, no more refreshes
    died = clock.now_ns
    run(engines, clock, 4)
    survivor = engines[1].dispatched["u"]
    # Within one lease period (+ grace) the survivor runs at the full limit.
    after = [t for t in survivor if t >= died + 3 * NS_PER_SECOND]
    assert len(after) >= 0.95 * 50 * (clock.now_ns - died - 3 * NS_PER_SECOND) / 1e9
    assert_global_bound(merged(engines, "u"), 50.0, 2)


def test_users_on_one_engine_cost_the_store_no_shared_tracking(
    redis_server, store_prefix
):
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 20.0, clock)
    engines[0].set_demand("only-a", 2)
    engines[1].set_demand("only-b", 2)
    run(engines, clock, 5)
    for engine, user in zip(engines, ["only-a", "only-b"], strict=True):
        assert engine.limiter.lease_rate(user) == 20.0
        snapshot = engine.limiter.store_snapshot()
        assert snapshot["shared_users"] == 0 and snapshot["blocked_users"] == 0
        # 5 s at 20 tok/s each, less the first answer's wait.
        assert 90 <= len(engine.dispatched[user]) <= 103


def test_a_user_that_leaves_gives_its_share_back(redis_server, store_prefix):
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 40.0, clock)
    engines[0].set_demand("u", 1)
    engines[1].set_demand("u", 1)
    run(engines, clock, 3)
    engines[0].set_demand("u", 0)
    left = clock.now_ns
    run(engines, clock, 3)
    assert engines[0].limiter.lease_rate("u") is None
    assert engines[1].limiter.lease_rate("u") == 40.0
    # Given back after 3 idle refresh cycles, free after the grace (0.45 s).
    late = delivered(engines, "u", left + 1_500 * MS, clock.now_ns)
    assert late[0] == 0 and late[1] >= 0.95 * 40 * 1.5


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    limit=st.sampled_from([7.5, 20.0, 100.0, 333.3]),
    streams=st.lists(st.integers(1, 5), min_size=2, max_size=3),
    step_ms=st.sampled_from([5, 10, 20]),
    changes=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 59)),
        max_size=6,
    ),
)
def test_the_global_bound_holds_whatever_the_demand(
    redis_server: RedisServer, limit, streams, step_ms, changes
) -> None:
    """Random demand per engine, changing at random times (0.1 s ticks over
    6 s): the merged dispatch log respects the global bound; with every
    engine's demand on from the start and no change, the long-run total is
    the limit."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    prefix = f"prop-{clock.now_ns}-{id(changes)}-{len(streams)}-{limit}"
    engines = make_engines(redis_server.url, prefix, len(streams), limit, clock)
    for engine, count in zip(engines, streams, strict=True):
        engine.set_demand("u", count)
    by_tick = {}
    for engine_index, count, tick in changes:
        by_tick.setdefault(tick, []).append((engine_index % len(engines), count))
    for tick in range(60):
        for engine_index, count in by_tick.get(tick, []):
            engines[engine_index].set_demand("u", count)
        run(engines, clock, 0.1, step_ms=step_ms)
    assert_global_bound(merged(engines, "u"), limit, len(engines))
    if not changes and limit * step_ms / 1000 < 1:
        # Each engine could take a token every step: demand far above its
        # share. From 1 s on, the total is the limit.
        start = 1_000 * NS_PER_SECOND + NS_PER_SECOND
        total = sum(delivered(engines, "u", start, clock.now_ns))
        assert total >= 0.97 * limit * 5 - len(engines), total
    for engine in engines:
        engine.close()


def test_a_store_that_dies_and_returns(tmp_path) -> None:
    """Both engines keep serving while the store is down (leases first, then
    the fallback share, limit / 2 each), and resume leases when it is back,
    with no burst: the merged log keeps the bound throughout."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    with RedisServer() as server:
        settings_ = StoreSettings(url=server.url, lease_s=1.0, timeout_s=0.2)
        engines = [SimEngine.create(f"e{i}", settings_, clock, 60.0) for i in range(2)]
        engines[0].set_demand("u", 3)
        engines[1].set_demand("u", 1)
        run(engines, clock, 3)
        server.kill()
        down = clock.now_ns
        run(engines, clock, 3)
        for engine in engines:
            assert engine.limiter.table.degraded
            assert engine.limiter.counters.fallbacks == 1
            # Shared users waited from the first failed round until the
            # fallback, a lease period after the last answer; not after.
            assert engine.limiter.failing_seconds() == pytest.approx(1.0, abs=0.15)
        failing = [engine.limiter.failing_seconds() for engine in engines]
        # After the leases ran out (1 s), each engine at half the limit.
        half = delivered(engines, "u", down + 1_500 * MS, clock.now_ns)
        for count in half:
            assert count == pytest.approx(30 * 1.5, abs=3), half
        server.start()  # empty: no leases, no limits; an engine seeds them
        back = clock.now_ns
        run(engines, clock, 4)
        for engine in engines:
            assert not engine.limiter.table.degraded
        assert [engine.limiter.failing_seconds() for engine in engines] == failing
        a, b = delivered(engines, "u", back + 2 * NS_PER_SECOND, clock.now_ns)
        assert a + b == pytest.approx(60 * 2, abs=4)
        assert a / b == pytest.approx(3, rel=0.1)
        assert_global_bound(merged(engines, "u"), 60.0, 2)
        for engine in engines:
            engine.close()


def test_a_store_back_for_one_engine_first_keeps_the_bound(tmp_path) -> None:
    """Seen end to end: the store came back and answered engine a first.
    Restarted, it knew nothing of b, still serving its fallback share, and
    granted a the whole limit. Until a lease period has passed, a user
    served at its fallback share keeps at most that share."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    with RedisServer() as server:
        settings_ = StoreSettings(url=server.url, lease_s=1.0, timeout_s=0.2)
        engines = [SimEngine.create(f"e{i}", settings_, clock, 60.0) for i in range(2)]
        for engine in engines:
            engine.set_demand("u", 2)
        run(engines, clock, 2)
        server.kill()
        run(engines, clock, 2)
        assert all(engine.limiter.table.degraded for engine in engines)
        server.start()
        failing_rounds(engines[1], 4)  # b's answers come 0.4 s after a's
        back = clock.now_ns
        run(engines, clock, 0.6)
        assert not any(engine.limiter.table.degraded for engine in engines)
        a, b = delivered(engines, "u", back + 100 * MS, clock.now_ns)
        assert a <= 30 * 0.5 + 2, (a, b)  # a at its fallback share, not more
        run(engines, clock, 3)
        assert_global_bound(merged(engines, "u"), 60.0, 2)
        a, b = delivered(engines, "u", clock.now_ns - NS_PER_SECOND, clock.now_ns)
        assert a + b >= 0.97 * 60 - 2, (a, b)  # then leases, the whole limit
        for engine in engines:
            engine.close()


def test_a_limit_changed_on_one_engine_reaches_the_other(redis_server, store_prefix):
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 50.0, clock)
    engines[1].set_demand("u", 1)
    run(engines, clock, 1)
    assert engines[1].limiter.lease_rate("u") == 50.0
    engines[0].limiter.update_rates(user_rates={"u": 10.0})
    run(engines, clock, 0.3)  # within a few refresh cycles
    assert engines[1].limiter.rate_of("u") == 10.0
    assert engines[1].limiter.lease_rate("u") == 10.0
    changed = clock.now_ns
    run(engines, clock, 2)
    count = delivered(engines, "u", changed, clock.now_ns)[1]
    assert count <= 10 * 2.1 + 1
    for engine in engines:
        engine.close()


def test_streams_that_come_and_go_still_get_the_whole_limit(
    redis_server, store_prefix
) -> None:
    """Each stream runs 24-token requests with a 100 ms pause between them
    (the client's turnaround), as in the end-to-end test: demand flickers,
    but shares follow the mean demand, so no grace is spent on flicker."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 40.0, clock)
    streams = [[0] * 3, [0]]  # tokens left per stream (0: pausing), per engine
    pauses = [[0] * 3, [0]]
    for tick in range(1200):  # 12 s, 10 ms steps
        clock.advance(10 * MS)
        for engine, left, pause in zip(engines, streams, pauses, strict=True):
            for i in range(len(left)):
                if left[i] == 0:
                    pause[i] -= 1
                    if pause[i] <= 0:
                        left[i] = 24
            engine.set_demand("u", sum(1 for n in left if n))
        if tick % 10 == 0:
            for engine in engines:
                engine.refresh()
        for engine, left, pause in zip(engines, streams, pauses, strict=True):
            got = engine.step().get("u", 0)
            for i in range(len(left)):
                if got and left[i]:
                    left[i] -= 1
                    got -= 1
                    if not left[i]:
                        pause[i] = 10
    start = clock.now_ns - 10 * NS_PER_SECOND
    a, b = delivered(engines, "u", start, clock.now_ns)
    assert a + b >= 0.95 * 40 * 10, (a, b)
    assert a / b == pytest.approx(3, rel=0.2), (a, b)
    assert_global_bound(merged(engines, "u"), 40.0, 2)
    for engine in engines:
        engine.close()


def test_limits_changed_after_a_store_restart_still_reach_every_engine() -> None:
    """A restarted store numbers its limits from 1 again: engines that had
    seen a higher version must still adopt what it holds."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    with RedisServer() as server:
        settings_ = StoreSettings(url=server.url, timeout_s=0.5)
        engines = [SimEngine.create(f"e{i}", settings_, clock, 50.0) for i in range(2)]
        for _ in range(3):
            engines[0].limiter.update_rates(user_rates={"x": 5.0})
            run(engines, clock, 0.3)
        assert engines[1].limiter.table.limits_version >= 3
        server.kill()
        run(engines, clock, 0.3)
        server.start()
        run(engines, clock, 0.5)  # an engine seeds the empty store
        engines[0].limiter.update_rates(user_rates={"x": 7.0})
        run(engines, clock, 0.5)
        assert engines[1].limiter.rate_of("x") == 7.0
        for engine in engines:
            engine.close()


def failing_rounds(engine: SimEngine, count: int, *, after_store: bool = False):
    """The next ``count`` rounds of ``engine`` fail as timeouts do; with
    ``after_store`` the store has done each one and only the answer is lost."""
    store = engine.refresher.store
    real = store.exchange
    left = [count]

    def exchange(*args, **kwargs):
        if left[0] <= 0:
            return real(*args, **kwargs)
        left[0] -= 1
        if after_store:
            real(*args, **kwargs)
        raise StoreUnavailable("timed out (test)")

    store.exchange = exchange


def test_a_round_that_fails_at_start_keeps_the_bound(redis_server, store_prefix):
    """Found on a loaded machine: an engine whose first rounds timed out
    served a new user at its fallback share (the whole limit: it had seen no
    other engine) while the other engine leased the limit. Until a lease
    period passes without an answer, a new user waits instead."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 40.0, clock)
    failing_rounds(engines[0], 5)
    engines[0].set_demand("u", 3)
    engines[1].set_demand("u", 1)
    run(engines, clock, 0.4)
    assert "u" not in engines[0].dispatched and not engines[0].limiter.table.degraded
    run(engines, clock, 5.6)
    assert_global_bound(merged(engines, "u"), 40.0, 2)
    a, b = delivered(engines, "u", clock.now_ns - 4 * NS_PER_SECOND, clock.now_ns)
    assert a + b >= 0.97 * 40 * 4 and a / b == pytest.approx(3, rel=0.1), (a, b)
    assert engines[0].limiter.counters.failures == 5
    assert engines[0].limiter.counters.fallbacks == 0


@pytest.mark.parametrize("seconds", [0.3, 1.5])
def test_lost_answers_pause_a_shared_user_and_keep_the_bound(
    redis_server, store_prefix, seconds
):
    """Engine a's rounds reach the store but their answers are lost (for
    less than a lease period), while b's new demand moves the shares: the
    store lowered a's share and, after the grace, gave the rest to b. a
    cannot know, so it holds its shared user back until an answer comes;
    users only a serves go on."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    engines = make_engines(redis_server.url, store_prefix, 2, 40.0, clock)
    for engine in engines:
        engine.set_demand("u", 1)
    engines[0].set_demand("only-a", 1)
    run(engines, clock, 2)
    engines[1].set_demand("u", 7)  # b now asks for 7/8 of u's limit
    failing_rounds(engines[0], round(seconds * 10), after_store=True)
    lost = clock.now_ns
    run(engines, clock, seconds)
    assert not engines[0].limiter.table.degraded
    paused = delivered(engines, "u", lost + 150 * MS, clock.now_ns)[0]
    assert paused == 0
    assert engines[0].limiter.failing_seconds() == pytest.approx(seconds, abs=0.15)
    # An unshared lease is renewed every half lease: it lasts at least 1 s.
    alone = delivered(engines, "only-a", lost, clock.now_ns)[0]
    assert alone >= 0.95 * 40 * min(seconds, 1.0), alone
    run(engines, clock, 3)
    assert_global_bound(merged(engines, "u"), 40.0, 2)
    a, b = delivered(engines, "u", clock.now_ns - 2 * NS_PER_SECOND, clock.now_ns)
    assert a + b >= 0.97 * 40 * 2 and b / a == pytest.approx(7, rel=0.1), (a, b)


def test_an_idle_engines_heartbeats_do_not_pile_up(redis_server, store_prefix):
    """An engine without requests takes no steps, so nothing applies its
    rounds' answers: ten heartbeats a second once piled up (a day idle was
    about 750 MB, and 2 s of applying at the next step). Answers that
    carry nothing are merged into one; what they say still counts."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    a, b = make_engines(redis_server.url, store_prefix, 2, 50.0, clock)
    a.set_demand("u", 1)
    run([a, b], clock, 1)
    a.set_demand("u", 0)
    run([a, b], clock, 1)  # u's lease given back
    assert a.limiter.lease_rate("u") is None
    exchanges = a.limiter.counters.exchanges
    b.limiter.update_rates(user_rates={"u": 10.0})
    for _ in range(3000):  # five minutes idle: a refreshes but takes no step
        clock.advance(100 * MS)
        a.refresh()
        b.refresh()
        b.step()
    assert len(a.limiter._results) == 1
    a.step()
    assert a.limiter.counters.exchanges == exchanges + 3000
    assert a.limiter.rate_of("u") == 10.0  # b's change, read while idle
    a.set_demand("u", 1)
    run([a, b], clock, 0.3)
    assert a.limiter.lease_rate("u") == 10.0
    for engine in (a, b):
        engine.close()


def test_a_blip_while_idle_is_no_fallback_when_traffic_returns(
    redis_server, store_prefix
):
    """An idle engine applies its rounds' answers at its next step, minutes
    later: a failed round is judged by when it was sent, so half a second
    without the store while idle is a blip, not a lease period of silence."""
    clock = FakeClock(1_000 * NS_PER_SECOND)
    (a,) = make_engines(redis_server.url, store_prefix, 1, 50.0, clock)
    a.set_demand("u", 1)
    run([a], clock, 1)
    a.set_demand("u", 0)
    run([a], clock, 1)
    failing_rounds(a, 5)
    for _ in range(600):  # a minute idle, its first half second failing
        clock.advance(100 * MS)
        a.refresh()
    a.set_demand("u", 1)
    run([a], clock, 0.5)
    counters = a.limiter.counters
    assert (counters.failures, counters.fallbacks) == (5, 0)
    assert not a.limiter.table.degraded and a.limiter.lease_rate("u") == 50.0
    a.close()
