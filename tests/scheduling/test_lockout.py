"""A throttled user never locks others out (``scheduling/residency.py``).

vLLM's real scheduler and KV cache manager, fake clock, sync and async
scheduling (the ``limited`` fixture also checks the accounting invariant).
The scarce thing is, in turn: resident slots (``--max-num-seqs``), KV
blocks, and the order of the waiting queue. The bound under test
(docs/architecture.md, "Nobody waits for a throttled request"): a request of
a user with budget samples its first token in the steps its own prefill
takes, as if the throttled requests were not there; here its prompt fits in
one step's token budget, so in the very step in which vLLM first sees it.
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import pairwise

import pytest

from harness.bounds import MS, S, assert_bound
from harness.scheduler_sim import SchedulerHarness
from vllm_output_rate.scheduling.demand import user_of
from vllm_output_rate.scheduling.step import Step

STEP_NS = 10 * MS
LIGHT = 1000.0  # the light users' limit: far from binding at 10 ms steps


def run(h: SchedulerHarness, seconds: float) -> None:
    for _ in range(round(seconds * S / STEP_NS)):
        h.step(STEP_NS)


def assert_first_token_in_its_first_step(h: SchedulerHarness, requests) -> None:
    waits = {
        r.request_id: h.first_token_step(r.request_id) - h.added_at[r.request_id]
        for r in requests
    }
    assert set(waits.values()) == {0}, waits


def assert_complete(h: SchedulerHarness, requests, length: int) -> None:
    for r in requests:
        assert len(h.outputs[r.request_id]) == length, r.request_id
        assert h.finished[r.request_id] == "length", r.request_id


def assert_limit_held(h: SchedulerHarness, user: str, rate: float) -> None:
    """The bound, and the limit reached while the user had demand."""
    times = h.sampled_at(user)
    assert_bound(times, rate)
    span_s = (times[-1] - times[0]) / S
    assert len(times) - 1 >= 0.98 * rate * span_s, (user, len(times), span_s)


def abort_all(h: SchedulerHarness, requests) -> None:
    """End a test's long-running requests (the fixture then checks the
    accounting)."""
    for r in requests:
        h.abort(r.request_id)


def residents(h: SchedulerHarness) -> Counter[str]:
    return Counter(map(user_of, h.scheduler.running))


def reclaimed(h: SchedulerHarness, user: str) -> int:
    users = h.scheduler.output_rate.metrics_snapshot()["labels"]
    return users.get(user, {}).get("reclaimed", 0)


# ----- resident slots --------------------------------------------------------


def test_a_hog_with_three_times_the_slots_in_streams_does_not_lock_others_out(
    limited,
) -> None:
    # The reproduction: 8 slots, 4 active; the hog's 24 streams take
    # every slot while it is alone, then light users arrive.
    h = limited(LIGHT, {"hog": 20}, max_num_seqs=8, max_num_active_seqs=4)
    hog = [h.add("hog", prompt_len=300, max_tokens=20) for _ in range(24)]
    run(h, 2)
    assert residents(h) == {"hog": 8}  # alone, it prefilled every slot ahead
    lights = []
    for i in range(10):  # a light request every 0.3 s, 50 tokens each
        lights.append(h.add(f"light-{i % 3}", prompt_len=200, max_tokens=50))
        run(h, 0.3)
    h.run_until_done(STEP_NS)
    assert_first_token_in_its_first_step(h, lights)
    for r in lights:  # then one token per step: full speed
        first = h.first_token_step(r.request_id)
        steps = [d.step for d in h.dispatches if d.request_id == r.request_id]
        assert steps == list(range(first, first + 50)), r.request_id
    assert_complete(h, lights, 50)
    assert_complete(h, hog, 20)  # paused, preempted, never cut
    assert_limit_held(h, "hog", 20)
    # One slot taken back for the first light request; afterwards the hog
    # does not refill freed slots ahead of its budget while others arrive.
    assert 1 <= reclaimed(h, "hog") <= 2


def test_throttled_users_at_their_cap_still_give_way(limited) -> None:
    # Four hogs arrive together: each keeps what its rate can feed (2 at
    # 5 tok/s) and together they fill all 8 slots; a light user must still
    # get in at once, by preemption.
    hogs = {f"hog-{i}": 5 for i in range(4)}
    h = limited(LIGHT, hogs, max_num_seqs=8, max_num_active_seqs=4)
    streams = [
        h.add(user, prompt_len=100, max_tokens=6) for user in hogs for _ in range(6)
    ]
    run(h, 1)
    assert residents(h) == {user: 2 for user in hogs}
    lights = []
    for _ in range(4):
        lights.append(h.add("light", prompt_len=100, max_tokens=30))
        run(h, 0.5)
    h.run_until_done(STEP_NS)
    assert_first_token_in_its_first_step(h, lights)
    assert_complete(h, lights, 30)
    assert_complete(h, streams, 6)
    for user in hogs:
        assert_bound(h.sampled_at(user), 5)
    assert sum(reclaimed(h, user) for user in hogs) >= 1


def test_a_limit_lowered_live_does_not_trap_the_slots(limited) -> None:
    h = limited(LIGHT, {"hog": 10_000}, max_num_seqs=8)
    hog = [h.add("hog", prompt_len=50, max_tokens=300) for _ in range(24)]
    run(h, 0.2)
    assert residents(h) == {"hog": 8}  # decoding at full speed
    h.scheduler.output_rate.update_limits({"user_output_tokens_per_second": {"hog": 5}})
    run(h, 1)
    light = h.add("light", prompt_len=100, max_tokens=20)
    run(h, 0.5)
    assert_first_token_in_its_first_step(h, [light])
    assert_complete(h, [light], 20)
    assert reclaimed(h, "hog") == 1
    abort_all(h, hog)


# ----- KV blocks ----------------------------------------------------------------


def test_throttled_residents_holding_the_kv_cache_give_it_up(limited) -> None:
    # Slots are plentiful (32); the KV cache (316 blocks of 16 tokens) holds
    # about 8 of the hog's 600-token requests, which its prefill ahead fills.
    h = limited(LIGHT, {"hog": 20}, num_blocks=316, max_num_seqs=32)
    hog = [h.add("hog", prompt_len=600, max_tokens=12) for _ in range(96)]
    run(h, 2)
    free_blocks = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert len(h.scheduler.running) < 32 and free_blocks < 26
    lights = []
    for i in range(6):  # 400-token prompts: 25 blocks each
        lights.append(h.add(f"light-{i % 2}", prompt_len=400, max_tokens=40))
        run(h, 0.25)
    run(h, 1)
    assert_first_token_in_its_first_step(h, lights)
    assert_complete(h, lights, 40)
    assert reclaimed(h, "hog") >= 1
    abort_all(h, hog)


# ----- churn and hysteresis -------------------------------------------------------


def test_a_steady_light_user_costs_the_hog_one_preemption(limited) -> None:
    h = limited(LIGHT, {"hog": 5}, max_num_seqs=8, max_num_active_seqs=4)
    hog = [h.add("hog", prompt_len=300, max_tokens=400) for _ in range(24)]
    run(h, 2)
    lights = []
    for _ in range(40):  # back to back, 10 s of them
        request = h.add("light", prompt_len=100, max_tokens=20)
        lights.append(request)
        while request.request_id not in h.finished:
            h.step(STEP_NS)
        h.step(STEP_NS)  # the client's round trip
    assert_first_token_in_its_first_step(h, lights)
    assert reclaimed(h, "hog") == 1
    assert h.preemptions == 1
    abort_all(h, hog)


def test_more_throttled_users_than_slots_take_turns_without_livelock(
    limited,
) -> None:
    # Two slots, five users at 5 tok/s: the slots are time-shared. A request
    # taken back is not taken again before it has sampled once more, and
    # every request finishes.
    users = {f"u{i}": 5 for i in range(5)}
    h = limited(LIGHT, users, max_num_seqs=2)
    requests = [h.add(user, prompt_len=40, max_tokens=8) for user in users]
    h.run_until_done(STEP_NS)
    assert_complete(h, requests, 8)
    for r in requests:
        steps = h.preempted_at.get(r.request_id, [])
        sampled = [
            d.step for d in h.dispatches if d.request_id == r.request_id and d.samples
        ]
        for before, after in pairwise(steps):
            assert any(before < s < after for s in sampled), (r.request_id, steps)
    for user in users:
        assert_bound(h.sampled_at(user), 5)
    stats = h.scheduler.output_rate.metrics_snapshot()["labels"]
    assert sum(s["reclaimed"] for s in stats.values()) == h.preemptions > 0
    assert all(stats[user]["recomputed_tokens"] > 0 for user in users)


def test_the_recompute_count_is_the_prefill_done_again(limited) -> None:
    # Without prefix caching a preempted request computes again all it had
    # computed: here its 64-token prompt (its one output token was sampled,
    # not yet computed).
    h = limited(LIGHT, {"hog": 1}, max_num_seqs=1, enable_prefix_caching=False)
    hog = h.add("hog", prompt_len=64, max_tokens=3)
    run(h, 0.5)  # its first token (the burst), then throttled until 1 s
    assert len(h.outputs[hog.request_id]) == 1
    light = h.add("light", prompt_len=16, max_tokens=2)
    h.run_until_done(STEP_NS)
    assert_first_token_in_its_first_step(h, [light])
    assert_complete(h, [hog], 3)
    assert_complete(h, [light], 2)
    assert len(h.preempted_at[hog.request_id]) == 1
    stats = h.scheduler.output_rate.metrics_snapshot()["labels"]
    assert stats["hog"]["reclaimed"] == 1
    assert stats["hog"]["recomputed_tokens"] == 64
    # The resumed chunk: the prompt again plus the sampled token.
    resumed = [d for d in h.dispatches if d.request_id == hog.request_id][1]
    assert (resumed.num_tokens, resumed.samples) == (65, True)


# ----- the waiting queue ----------------------------------------------------------


def test_queued_throttled_streams_cost_no_scan(limited, monkeypatch) -> None:
    h = limited(LIGHT, {"hog": 5}, max_num_seqs=16)
    calls = []
    admit = Step.admit_waiting
    monkeypatch.setattr(
        Step, "admit_waiting", lambda step, r: calls.append(h.steps) or admit(step, r)
    )
    h.add("light", max_tokens=2000)  # it claims a slot, so the hog is capped
    for _ in range(2000):
        # One-token prompts: nothing to prefill ahead, they can only sample.
        h.add("hog", prompt_len=1, max_tokens=100)
    run(h, 0.1)
    # Slots are free and the hog holds less than its rate could feed, but
    # none of its queued streams can be admitted without budget: after one
    # fruitless scan, no scan until something changes (here the free KV
    # blocks, as the light request grows by a block every 16 tokens).
    assert len(h.scheduler.running) < 16
    start = h.steps
    run(h, 0.5)
    scans = Counter(step for step in calls if step > start)
    assert len(scans) <= 4 and len(h.scheduler.running) < 16, scans
    late = h.add("late", max_tokens=5)  # behind 1,998 queued streams
    run(h, 0.2)
    assert_first_token_in_its_first_step(h, [late])


@pytest.mark.parametrize(("light_priority", "gets_in"), [(0, True), (5, False)])
def test_under_priority_a_slot_is_taken_only_within_its_priority(
    limited, light_priority: int, gets_in: bool
) -> None:
    h = limited(LIGHT, {"hog": 5}, max_num_seqs=4, policy="priority")
    for _ in range(12):
        h.add("hog", prompt_len=50, max_tokens=100, priority=0)
    run(h, 1)
    light = h.add("light", prompt_len=50, max_tokens=5, priority=light_priority)
    run(h, 0.2)
    if gets_in:
        assert_first_token_in_its_first_step(h, [light])
    else:  # the hog's requests rank better: as in stock vLLM, it waits
        assert h.first_token_step(light.request_id) is None
        assert h.preemptions == 0
    h.abort(light.request_id)


# ----- randomized --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_hogs_never_keep_a_light_user_waiting(limited, seed: int) -> None:
    rng = random.Random(seed)
    seqs = rng.choice([4, 8, 16])
    hog_rates = {
        f"hog-{i}": rng.choice([1, 2.5, 5, 20]) for i in range(rng.randint(1, 3))
    }
    policy = rng.choice(["fcfs", "priority"])
    h = limited(
        LIGHT,
        hog_rates,
        max_num_seqs=seqs,
        max_num_active_seqs=rng.choice([None, max(1, seqs // 2)]),
        num_blocks=rng.choice([10_000, seqs * 40]),
        max_num_batched_tokens=512,
        policy=policy,
    )
    hog_requests = []
    for user in hog_rates:
        for _ in range(3 * seqs // len(hog_rates)):
            length = rng.randint(1, 12)
            hog_requests.append(
                (h.add(user, prompt_len=rng.randint(8, 300), max_tokens=length), length)
            )
    run(h, rng.uniform(0.5, 2))
    lights = []
    for _ in range(8):
        length = rng.randint(1, 30)
        request = h.add(
            f"light-{len(lights)}",  # a user with nothing resident
            prompt_len=rng.randint(1, 400),
            max_tokens=length,
        )
        lights.append((request, length))
        run(h, rng.uniform(0.05, 0.6))
    h.run_until_done(STEP_NS, max_steps=200_000)
    assert_first_token_in_its_first_step(h, [r for r, _ in lights])
    for request, length in lights + hog_requests:
        assert_complete(h, [request], length)
    for user, rate in hog_rates.items():
        assert_bound(h.sampled_at(user), rate)
