"""The rate-limiting scheduler on vLLM's real scheduler and KV cache manager.

Every test runs for synchronous and asynchronous scheduling, with a fake clock
driving the limiter; the ``limited`` fixture (conftest.py) checks the
accounting invariant after each test.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from harness.bounds import MS, S, assert_bound
from harness.counting_limiter import watch_updates
from harness.scheduler_sim import (
    FakeClock,
    SchedulerHarness,
    make_scheduler,
)
from vllm_output_rate.integration.scheduler import OutputRateMixin
from vllm_output_rate.scheduling.demand import USER_ATTR

# ----- semantics 1-4 ------------------------------------------------------


def test_only_output_tokens_count(limited) -> None:
    h = limited(10)
    request = h.add("a", prompt_len=1500, max_tokens=3)
    h.step(10 * MS)
    # The whole 1,500-token prompt ran in one step and sampled one token.
    assert h.dispatches[0].num_tokens == 1500 and h.dispatches[0].samples
    h.run_until_done(10 * MS)
    assert h.outputs[request.request_id] == [42, 42, 42]


def test_one_budget_shared_by_all_streams_of_a_user(limited) -> None:
    h = limited(10)
    for _ in range(4):
        h.add("a", max_tokens=1000)
    for _ in range(200):  # 6 s of 30 ms steps
        h.step(30 * MS)
    sampled = h.sampled_at("a")
    assert_bound(sampled, 10)
    span_s = (sampled[-1] - sampled[0]) / S
    assert len(sampled) - 1 >= 10 * span_s - 1  # the whole budget is used


def test_throttled_requests_pause_and_finish_complete(limited) -> None:
    h = limited(20)
    full = [h.add("a", max_tokens=30) for _ in range(3)]
    ends_at_eos = h.add("a", max_tokens=30, eos_at=9)
    h.run_until_done(10 * MS)
    for request in full:
        assert h.outputs[request.request_id] == [42] * 30
        assert h.finished[request.request_id] == "length"
    assert h.outputs[ends_at_eos.request_id][-1] == h.eos_token_id
    assert len(h.outputs[ends_at_eos.request_id]) == 10
    assert h.finished[ends_at_eos.request_id] == "stop"
    assert_bound(h.sampled_at("a"), 20)


def test_a_throttled_user_does_not_slow_others(limited) -> None:
    h = limited(5, {"fast": 10_000})
    for _ in range(8):
        h.add("slow", max_tokens=500)
    fast = h.add("fast", max_tokens=100)
    for _ in range(100):
        h.step(10 * MS)
    # The fast user's request samples in every step after its prefill.
    assert len(h.sampled_by_request(fast.request_id)) == 100
    assert_bound(h.sampled_at("slow"), 5)


def test_requests_without_a_user_share_the_anonymous_budget(limited) -> None:
    h = limited(10)
    for _ in range(3):
        h.add(None, max_tokens=200)
    h.add("x", extra_args={"output_rate_user": 5}, max_tokens=200)  # malformed
    for _ in range(200):
        h.step(20 * MS)
    assert set(h.users.values()) == {"__anonymous__"}
    anonymous = [d.time_ns for d in h.dispatches if d.samples]
    assert_bound(anonymous, 10)  # the malformed name fell back to anonymous


# ----- charging -------------------------------------------------------------


def test_prefill_chunks_are_free_and_the_last_one_pays(limited) -> None:
    h = limited(10, max_num_batched_tokens=64)
    request = h.add("a", prompt_len=200, max_tokens=2)
    for _ in range(4):
        h.step(10 * MS)
    chunks = [d for d in h.dispatches if d.request_id == request.request_id]
    assert [d.num_tokens for d in chunks] == [64, 64, 64, 8]
    assert [d.samples for d in chunks] == [False, False, False, True]
    assert h.scheduler.output_rate.limiter.net["a"] == 1


def test_tokens_charged_to_undispatched_requests_are_refunded(limited) -> None:
    # 12 KV blocks: the requests cannot all grow; vLLM preempts and the
    # allocation failures must not cost budget (checked by the fixture).
    h = limited(1000, num_blocks=12)
    for _ in range(6):
        h.add("a", prompt_len=30, max_tokens=40)
    h.run_until_done(5 * MS)
    assert all(h.finished[r] == "length" for r in h.outputs)
    assert any(h.scheduler.requests.get(r) is None for r in h.outputs)


def test_a_refused_user_is_asked_once_per_step(limited) -> None:
    h = limited(1)
    for _ in range(50):
        h.add("a", max_tokens=100)
    h.add("b", max_tokens=100)
    for _ in range(10):
        h.step(10 * MS)
    limiter = h.scheduler.output_rate.limiter
    # One reservation per user per step, however many requests it has.
    assert limiter.user_calls["a"] <= h.steps
    assert limiter.user_calls["b"] <= h.steps


# ----- prefill without budget -----------------------------------------------


def test_chunked_prefill_advances_up_to_the_sampling_position(limited) -> None:
    h = limited(2)
    h.add("a", max_tokens=1)  # spends the burst
    h.add("a", max_tokens=1)
    h.step(1 * MS)
    late = h.add("a", prompt_len=100, max_tokens=1)
    h.step(1 * MS)
    first = [d for d in h.dispatches if d.request_id == late.request_id]
    assert [(d.num_tokens, d.samples) for d in first] == [(99, False)]
    h.run_until_done(10 * MS)
    chunks = [d for d in h.dispatches if d.request_id == late.request_id]
    assert [(d.num_tokens, d.samples) for d in chunks] == [(99, False), (1, True)]
    assert chunks[1].time_ns - chunks[0].time_ns >= 400 * MS


def test_without_chunked_prefill_the_whole_prefill_waits(limited) -> None:
    h = limited(2, enable_chunked_prefill=False)
    h.add("a", max_tokens=1)
    h.add("a", max_tokens=1)
    h.step(1 * MS)
    late = h.add("a", prompt_len=100, max_tokens=1)
    h.run_until_done(10 * MS)
    chunks = [d for d in h.dispatches if d.request_id == late.request_id]
    assert [(d.num_tokens, d.samples) for d in chunks] == [(100, True)]


@pytest.mark.parametrize("chunked", [True, False])
def test_a_throttled_waiting_request_does_not_block_others(
    limited, chunked: bool
) -> None:
    h = limited(1, enable_chunked_prefill=chunked)
    h.add("a", max_tokens=1)
    h.step(1 * MS)  # user a's budget is spent
    # A one-token prompt can only run by sampling, even with chunked prefill.
    blocked = h.add("a", prompt_len=1, max_tokens=1)
    behind = h.add("b", max_tokens=1)
    h.step(1 * MS)
    scheduled = {d.request_id for d in h.dispatches if d.step == h.steps}
    assert behind.request_id in scheduled
    assert blocked.request_id not in scheduled
    h.run_until_done(10 * MS)
    assert h.outputs[blocked.request_id] == [42]


def test_a_throttled_prompt_that_does_not_fit_does_not_block_others(
    limited,
) -> None:
    # 20 blocks: a's 400-token prompt (25 blocks) cannot be admitted; vLLM
    # would stop its scan at the failed allocation and b would wait too.
    h = limited(1, {"b": 100}, num_blocks=20)
    h.add("a", max_tokens=1)
    h.step(1 * MS)  # user a's budget is spent
    h.add("a", prompt_len=400, max_tokens=1)
    behind = h.add("b", max_tokens=3)
    h.step(1 * MS)
    assert behind.request_id in {d.request_id for d in h.dispatches}


# ----- residency and active slots --------------------------------------------


def test_throttled_requests_stay_resident_and_free_their_active_slot(
    limited,
) -> None:
    h = limited(1, {"b": 1000}, max_num_seqs=8, max_num_active_seqs=2)
    a1, a2 = h.add("a", max_tokens=50), h.add("a", max_tokens=50)
    h.step(1 * MS)
    h.step(1 * MS)  # a's burst is spent; both a requests are throttled
    blocks_before = h.scheduler.kv_cache_manager.get_block_ids(a1.request_id)
    b = h.add("b", max_tokens=5)
    h.step(1 * MS)
    scheduler = h.scheduler
    assert b in scheduler.running and b.request_id in scheduler.requests
    assert {a1, a2} <= set(scheduler.running)  # still resident
    assert scheduler.kv_cache_manager.get_block_ids(a1.request_id) == blocks_before
    assert {d.request_id for d in h.dispatches if d.step == h.steps} == {b.request_id}
    assert scheduler.max_num_active_reqs == 2  # restored after the step


def test_max_num_seqs_still_bounds_resident_requests(limited) -> None:
    h = limited(1, max_num_seqs=4, max_num_active_seqs=2)
    for _ in range(10):
        h.add("a", max_tokens=20)
    for _ in range(50):
        h.step(5 * MS)
        assert len(h.scheduler.running) <= 4
        active = [d for d in h.dispatches if d.step == h.steps]
        assert len(active) <= 2


def test_active_slots_are_shared_fairly_between_users(limited) -> None:
    # Everyone may sample 2 tokens per 10 ms step, but only 3 requests may
    # be active per step. Users must share those 3 slots, not streams: the
    # user with 6 streams would otherwise take 2 slots (its whole budget)
    # and leave the other two users half a slot each.
    h = limited(200, max_num_seqs=16, max_num_active_seqs=3)
    for _ in range(6):
        h.add("many", max_tokens=2000)
    h.add("one", max_tokens=2000)
    h.add("two", max_tokens=2000)
    for _ in range(100):  # until everyone is resident and budgets settle
        h.step(10 * MS)
    resident = Counter(getattr(r, USER_ATTR) for r in h.scheduler.running)
    # Everyone is resident; many's other streams wait: the slots it could
    # take go to the users owed more (fair_share.py), and one resident
    # stream per user fills the three active slots (no slot is left idle).
    assert resident.keys() == {"many", "one", "two"}
    start = len(h.dispatches)
    for _ in range(100):
        h.step(10 * MS)
    served = Counter(d.user for d in h.dispatches[start:])
    for user in ("many", "one", "two"):
        assert 90 <= served[user] <= 110, served


def test_streams_of_one_user_take_turns(limited) -> None:
    h = limited(10)
    streams = [h.add("a", max_tokens=1000) for _ in range(4)]
    for _ in range(400):  # 12 s of 30 ms steps
        h.step(30 * MS)
    for request in streams:
        times = h.sampled_by_request(request.request_id)
        # 2.5 tok/s each, +-1 token, over every 4-second window.
        for start in range(2 * S, 8 * S, 100 * MS):
            lo, hi = times[0] + start, times[0] + start + 4 * S
            count = sum(lo <= t < hi for t in times)
            assert 9 <= count <= 11, (request.request_id, start, count)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_throttled_requests_are_preempted_first(limited, policy: str) -> None:
    # Each request grows to 6 blocks; 16 blocks cannot hold all five.
    h = limited(1, {"b": 1000}, num_blocks=16, policy=policy)
    throttled = [h.add("a", prompt_len=32, max_tokens=60) for _ in range(2)]
    for _ in range(3):
        h.step(1 * MS)
    growing = [h.add("b", prompt_len=32, max_tokens=60) for _ in range(3)]
    preempted: list[str] = []
    for _ in range(60):
        output = h.step(1 * MS)
        preempted += sorted(output.preempted_req_ids)
        if preempted:
            break
    # The first victims of KV pressure are a's throttled requests.
    assert preempted and set(preempted) <= {r.request_id for r in throttled}
    assert all(r in h.scheduler.running for r in growing)
    h.run_until_done(20 * MS)
    assert all(len(h.outputs[r.request_id]) == 60 for r in throttled + growing)


def test_priority_policy_prefers_throttled_only_within_a_priority(limited) -> None:
    # a (throttled) has the better priority; b's worse-priority requests are
    # preempted first, as stock vLLM would.
    h = limited(1, {"b": 1000}, num_blocks=16, policy="priority")
    throttled = [h.add("a", prompt_len=32, max_tokens=60, priority=0) for _ in range(2)]
    for _ in range(3):
        h.step(1 * MS)
    for _ in range(3):
        h.add("b", prompt_len=32, max_tokens=60, priority=5)
    preempted: list[str] = []
    for _ in range(60):
        preempted += sorted(h.step(1 * MS).preempted_req_ids)
    assert preempted
    assert not set(preempted) & {r.request_id for r in throttled}
    h.run_until_done(20 * MS)


# ----- the engine loop ------------------------------------------------------


def test_idle_wait_until_the_next_token_is_due(limited) -> None:
    h = limited(10)
    h.add("a", max_tokens=100)
    h.step(1 * MS)
    h.step(1 * MS)  # burst spent: 2 tokens
    output = h.step(1 * MS)
    scheduler = h.scheduler
    assert output.total_num_scheduled_tokens == 0
    due = scheduler.output_rate.limiter.ready_at_ns("a")
    expected = min(0.05, (due - h.clock.now_ns) / 1e9)
    assert scheduler.output_rate.idle_wait_s() == pytest.approx(expected)
    assert 0 < scheduler.output_rate.idle_wait_s() <= 0.05
    h.add("b", max_tokens=100)
    h.step(1 * MS)  # b runs: the engine must not wait
    assert scheduler.output_rate.idle_wait_s() == 0


def test_stock_behaviour_when_limits_never_bind(
    tiny_model_path: str, is_async: bool, limited
) -> None:
    def workload(h: SchedulerHarness) -> list[tuple[int, str, int, bool]]:
        for i in range(12):
            h.add(f"user-{i % 3}", prompt_len=5 + 37 * i % 300, max_tokens=20 + i)
        h.run_until_done(1 * MS)
        return [(d.step, d.request_id, d.num_tokens, d.samples) for d in h.dispatches]

    stock = make_scheduler(
        tiny_model_path, limits=None, is_async=is_async, max_num_batched_tokens=256
    )
    # Three users' prompts exceed the step's 256 tokens at times: the same as
    # stock when vLLM sizes every chunk (fair step tokens: test_token_shares).
    ours = limited(1e6, max_num_batched_tokens=256, fair_step_tokens=False)
    assert workload(ours) == workload(stock)


def test_while_no_limit_binds_the_per_request_hook_is_skipped(
    limited, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fast path: vLLM's own hook runs instead of ours and the step is
    # charged afterwards (the fixture checks charges == sampled tokens).
    hook_calls = Counter()
    ours = OutputRateMixin._reserve_prefill_lookahead

    def counted(self, request, *args):
        hook_calls[getattr(request, USER_ATTR)] += 1
        return ours(self, request, *args)

    monkeypatch.setattr(OutputRateMixin, "_reserve_prefill_lookahead", counted)
    h = limited(1e6, {"slow": 1}, max_num_batched_tokens=64)
    for _ in range(4):
        h.add("fast", prompt_len=150, max_tokens=10)  # chunked prefills too
    h.run_until_done(1 * MS)
    assert hook_calls["fast"] == 0
    assert len(h.sampled_at("fast")) == 40
    for _ in range(2):
        h.add("slow", max_tokens=3)
    h.run_until_done(100 * MS)
    assert hook_calls["slow"] > 0  # binding: each request goes through ours
    assert len(h.sampled_at("slow")) == 6


def test_demand_is_tracked_without_recounting(
    limited, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each step's reservation is sized to the user's unfinished requests,
    # kept from adds and vLLM's finished ids; a recount is only a fallback.
    h = limited(40, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = h.scheduler
    demand = scheduler.output_rate.demand
    recounts = []
    recount = demand.recount
    monkeypatch.setattr(
        demand, "recount", lambda requests: recounts.append(1) or recount(requests)
    )
    count = demand.count_unfinished
    checked = []

    def checked_count(finished_ids, requests):
        result = count(finished_ids, requests)
        truth = Counter(getattr(r, USER_ATTR) for r in scheduler.requests.values())
        checked.append(result == dict(truth) and 0 not in result.values())
        return result

    monkeypatch.setattr(demand, "count_unfinished", checked_count)
    rng = random.Random(7)
    live = []
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            user = f"user-{rng.randrange(3)}"
            live.append(h.add(user, prompt_len=rng.randrange(2, 90), max_tokens=8))
        if live and rng.random() < 0.05:
            h.abort(live.pop(rng.randrange(len(live))).request_id)
        h.step(5 * MS)
    h.run_until_done(5 * MS)
    assert checked and all(checked)
    assert not recounts
    assert (
        not scheduler.output_rate.demand.unfinished
        and not scheduler.output_rate.demand.user_by_id
    )


def test_memory_of_idle_users_is_released(tiny_model_path: str) -> None:
    clock = FakeClock()
    h = make_scheduler(
        tiny_model_path,
        limits={"default_user_output_tokens_per_second": 100},
        clock=clock,
    )
    for i in range(300):
        h.add(f"user-{i}", max_tokens=1)
    h.run_until_done(50 * MS)
    for _ in range(300):
        h.step(50 * MS)
    assert len(h.scheduler.output_rate.limiter) == 0


def test_a_simulated_minute_of_mixed_traffic(limited) -> None:
    """Many users and streams, random prompts and answers, KV pressure."""
    rng = random.Random(20261130)
    rates = {f"user-{i}": rng.choice([0.5, 2, 5, 10, 20]) for i in range(12)}
    # 400 blocks of 16 tokens hold about 30 of the ~40 concurrent requests.
    h = limited(
        20,
        rates,
        num_blocks=400,
        max_num_seqs=64,
        max_num_active_seqs=16,
        max_num_batched_tokens=256,
    )
    shared_prefix = [rng.randrange(10, 400) for _ in range(48)]
    streams = [(user, i) for user in rates for i in range(rng.randint(2, 5))]
    streams += [("anonymous", 0), ("anonymous", 1)]
    expected: dict[str, int] = {}
    current: dict[tuple[str, int], str] = {}

    def submit(stream: tuple[str, int]) -> None:
        user = stream[0] if stream[0] != "anonymous" else None
        prompt_len = rng.randint(1, 300)
        prompt = None
        if rng.random() < 0.3:  # prefix-cache hits
            prompt = shared_prefix + [rng.randrange(10, 400) for _ in range(prompt_len)]
        max_tokens = rng.randint(1, 120)
        eos_at = rng.randrange(max_tokens) if rng.random() < 0.2 else None
        request = h.add(
            user,
            prompt_len=prompt_len,
            prompt=prompt,
            max_tokens=max_tokens,
            eos_at=eos_at,
        )
        expected[request.request_id] = max_tokens if eos_at is None else eos_at + 1
        current[stream] = request.request_id

    for stream in streams:
        submit(stream)
    start_ns = h.clock.now_ns
    while h.clock.now_ns - start_ns < 60 * S:
        h.step(rng.randint(5, 40) * MS)
        for stream in streams:
            if current[stream] in h.finished:
                submit(stream)
    h.run_until_done(20 * MS)

    for request_id, length in expected.items():
        assert len(h.outputs[request_id]) == length, request_id
    for user, rate in {**rates, "__anonymous__": 20}.items():
        sampled = h.sampled_at(user)
        assert_bound(sampled, rate)
        in_minute = [t for t in sampled if t < start_ns + 60 * S]
        # Demand always exceeds the limit: nobody is starved.
        assert len(in_minute) >= 0.85 * rate * 60, (user, rate, len(in_minute))
    assert h.preemptions > 0  # KV pressure was real


def test_update_from_output_never_touches_the_limiter(limited) -> None:
    h = limited(10)
    for _ in range(3):
        h.add("a", max_tokens=20)
    untouched = watch_updates(h)
    h.run_until_done(20 * MS)
    assert untouched and all(untouched)


# The scheduler's entry points vLLM's engine calls, and the policy method
# each settles the last step in (the override itself, or begin_step).
SETTLING_ENTRY_POINTS = {
    "schedule": "begin_step",
    "get_grammar_bitmask": "get_grammar_bitmask",
    "update_from_output": "update_from_output",
    "add_request": "add_request",
    "finish_requests": "finish_requests",
}


@pytest.mark.parametrize("asks_bitmask", [True, False], ids=["bitmask", "no-bitmask"])
def test_no_vllm_code_sees_a_step_before_it_is_settled(
    limited, monkeypatch, asks_bitmask: bool
) -> None:
    """The step is settled off the critical path (``get_grammar_bitmask``),
    or else by whichever entry point comes first: vLLM's own code never runs
    between a step and its settling, whatever the engine does in between."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_output_rate.integration.engine_rpc import output_rate_rpc

    h = limited(30, {"b": 100})
    h.asks_grammar_bitmask = asks_bitmask
    policy = h.scheduler.output_rate
    settled_in: Counter[str] = Counter()
    finish_step = policy.finish_step

    def spied_finish_step() -> None:
        if policy.unsettled is not None:
            settled_in[sys._getframe(1).f_code.co_name] += 1
        finish_step()

    monkeypatch.setattr(policy, "finish_step", spied_finish_step)
    unsettled_in: list[str] = []

    def spy_on(name: str) -> None:
        base = getattr(Scheduler, name)

        def spied(self, *args, **kwargs):
            if policy.unsettled is not None:
                unsettled_in.append(name)
            return base(self, *args, **kwargs)

        monkeypatch.setattr(Scheduler, name, spied)

    for name in SETTLING_ENTRY_POINTS:
        spy_on(name)

    rng = random.Random(3)
    engine = SimpleNamespace(scheduler=h.scheduler)
    for user in ("a", "a", "a", "b", "c"):
        h.add(user, max_tokens=40)

    def meanwhile() -> None:
        """An abort, a new request or an operator's read, at random."""
        roll = rng.random()
        if roll < 0.15 and h.scheduler.requests:
            h.abort(rng.choice(sorted(h.scheduler.requests)))
        elif roll < 0.4:
            h.add(rng.choice("abc"), max_tokens=rng.randint(1, 40))
        elif roll < 0.5:
            output_rate_rpc(engine, "metrics")

    for _ in range(300):
        h.step(10 * MS, between=meanwhile)
    h.run_until_done(10 * MS)

    assert not unsettled_in
    for user, rate in {"a": 30, "b": 100, "c": 30}.items():
        assert_bound(h.sampled_at(user), rate)
    # Each entry point that came first after a step settled some step (the
    # operator channel too); with the bitmask asked for, the steps nothing
    # came between were settled there, before the model's output.
    expected = {"add_request", "finish_requests", "output_rate_rpc"}
    if asks_bitmask:
        assert expected | {"get_grammar_bitmask"} == set(settled_in), settled_in
    else:
        assert expected | {"update_from_output"} == set(settled_in), settled_in


def test_a_cancelled_step_is_not_refunded(limited) -> None:
    h = limited(10)
    request = h.add("a", max_tokens=50)
    h.step(1 * MS)
    h.step(1 * MS)
    charged = h.scheduler.output_rate.limiter.net["a"]
    assert charged == 2
    h.abort(request.request_id)  # the client went away after dispatch
    h.run_until_done(1 * MS)
    assert h.scheduler.output_rate.limiter.net["a"] == charged


def test_async_look_ahead_after_a_stop_is_charged(limited, is_async: bool) -> None:
    h = limited(1000)
    request = h.add("a", max_tokens=50, eos_at=4)
    h.run_until_done(1 * MS)
    assert len(h.outputs[request.request_id]) == 5
    # Async scheduling dispatched one more step before it learnt of the stop;
    # that token stays charged (an upper bound, never an undercount).
    assert h.scheduler.output_rate.limiter.net["a"] == 5 + is_async


def test_the_dispatch_log_records_every_charged_token(
    tiny_model_path: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_output_rate.scheduling.dispatch_log import ENV, read_dispatch_log

    log = tmp_path / "dispatch.csv"
    monkeypatch.setenv(ENV, str(log))
    h = make_scheduler(
        tiny_model_path, limits={"default_user_output_tokens_per_second": 10}
    )
    for _ in range(3):
        h.add("a", max_tokens=5)
    h.add("b", max_tokens=5)
    h.run_until_done(10 * MS)
    # A reader of a running engine sees all but the last second.
    early = read_dispatch_log(str(log))
    last_ns = max(d.time_ns for d in h.dispatches)
    for user in ("a", "b"):
        sampled = h.sampled_at(user)
        assert early[user] == sampled[: len(early[user])]
        assert all(t in early[user] for t in sampled if t <= last_ns - S)
    h.scheduler.output_rate.dispatch_log.flush()
    logged = read_dispatch_log(str(log))
    assert logged == {user: h.sampled_at(user) for user in ("a", "b")}


def test_a_live_rate_change_applies_from_the_next_step(limited) -> None:
    h = limited(50)
    for _ in range(3):
        h.add("a", max_tokens=2000)
    for _ in range(100):
        h.step(10 * MS)
    changed_at = h.clock.now_ns
    h.scheduler.output_rate.update_limits({"user_output_tokens_per_second": {"a": 5}})
    limits = h.scheduler.output_rate.limits()
    assert limits["user_output_tokens_per_second"] == {"a": 5}
    for _ in range(400):
        h.step(10 * MS)
    before = [t for t in h.sampled_at("a") if t < changed_at]
    after = [t for t in h.sampled_at("a") if t >= changed_at]
    assert_bound(before, 50)
    assert_bound(after, 5)  # no burst granted by the change
    assert len(after) >= 5 * 3.9
    with pytest.raises(ValueError, match="got -2"):
        h.scheduler.output_rate.update_limits(
            {"user_output_tokens_per_second": {"b": -2}}
        )
    assert h.scheduler.output_rate.limits()["user_output_tokens_per_second"] == {"a": 5}


def test_the_limits_page_through_every_user_with_a_setting_of_its_own(
    limited,
) -> None:
    h = limited(50)
    policy = h.scheduler.output_rate
    policy.update_limits(
        {
            "user_output_tokens_per_second": {f"u{i:02}": i + 1 for i in range(7)},
            "user_output_weight": {"w-only": 3, "u03": 2},
            "user_min_output_tokens_per_second": {"f-only": 1},
        }
    )
    pages, after = [], None
    while True:
        page = policy.limits_page(3, after)
        assert page["total"] == 9
        pages.append(page["limits"])
        after = page["next"]
        if after is None:
            break
    assert len(pages) == 3  # 9 users, 3 a page, no empty last page
    names = [
        sorted(
            {
                *p["user_output_tokens_per_second"],
                *p["user_output_weight"],
                *p["user_min_output_tokens_per_second"],
            }
        )
        for p in pages
    ]
    assert names == [
        ["f-only", "u00", "u01"],
        ["u02", "u03", "u04"],
        ["u05", "u06", "w-only"],
    ]
    whole = policy.limits()
    for key in (
        "user_output_tokens_per_second",
        "user_output_weight",
        "user_min_output_tokens_per_second",
    ):
        merged = {u: v for p in pages for u, v in p[key].items()}
        assert merged == whole[key]
    assert all(p["default_user_output_tokens_per_second"] == 50 for p in pages)
    # A page is a valid change, and putting it back changes nothing.
    policy.update_limits(pages[1])
    assert policy.limits() == whole
    past_the_end = policy.limits_page(3, "zzz")
    assert past_the_end["next"] is None and past_the_end["total"] == 9
    assert past_the_end["limits"]["user_output_tokens_per_second"] == {}


def test_statistics_keep_label_cardinality_bounded(
    tiny_model_path: str, is_async: bool
) -> None:
    h = make_scheduler(
        tiny_model_path,
        limits={
            "default_user_output_tokens_per_second": 1000,
            "metrics_users": ["named"],
            "metrics_recent_users": 2,
        },
        is_async=is_async,
    )
    h.add("named", max_tokens=3)
    h.add(None, max_tokens=2)
    for i in range(50):
        h.add(f"stranger-{i}", max_tokens=1)
    h.run_until_done(1 * MS)
    policy = h.scheduler.output_rate
    labels = policy.metrics_snapshot()["labels"]
    # The listed user, anonymous, two recent users; the other 48 share one.
    assert set(labels) == {
        "named",
        "__anonymous__",
        "stranger-0",
        "stranger-1",
        "__other__",
    }
    assert labels["named"]["tokens_admitted"] == 3
    assert labels["__other__"]["tokens_admitted"] == 48
    assert labels["named"]["token_gap"]["count"] == 2
    assert policy.metrics_snapshot()["limits"]["__default__"] == 1000
    # The admin view has every user, with its limit and first-token time.
    page = policy.users_snapshot(limit=100)
    assert page["total"] == 52 and page["next"] is None
    assert page["users"]["stranger-49"]["tokens_admitted"] == 1
    assert page["users"]["stranger-49"]["label"] == "__other__"
    assert page["users"]["named"]["limit"] == 1000
    assert all(view["first_tokens"] == 1 for view in page["users"].values())


def test_first_token_time_counts_the_wait_for_budget(limited) -> None:
    # 1 tok/s: the second request's first token waits about one second.
    h = limited(1, {"fast": 1000})
    h.add("slow", max_tokens=1)
    h.add("slow", max_tokens=1)
    h.add("fast", max_tokens=1)
    h.run_until_done(10 * MS)
    users = h.scheduler.output_rate.users_snapshot(limit=10)["users"]
    assert users["fast"]["first_tokens"] == 1
    assert users["fast"]["first_token_sum_s"] < 0.05
    assert users["slow"]["first_tokens"] == 2
    # One at once (burst), one after about 1 s (the limit), on the fake clock.
    assert 0.9 <= users["slow"]["first_token_sum_s"] <= 1.2
