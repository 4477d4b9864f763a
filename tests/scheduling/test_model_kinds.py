"""Hybrid (Mamba) and multimodal models, LoRA adapters and pipeline
parallelism, on vLLM's real scheduler and KV cache manager.

A throttled request is held back short of its sampling position or skipped;
these tests check that neither breaks what each mode relies on: Mamba state
cached at block boundaries, multimodal placeholders and encoder runs,
``--max-loras``, and several batches in flight. The accounting invariant is
checked after every test (``limited``, conftest.py).
"""

from __future__ import annotations

from collections import Counter

import pytest

from harness.bounds import MS, assert_bound
from harness.scheduler_sim import HYBRID_BLOCK_SIZE, SchedulerHarness, make_scheduler


def chunks(h: SchedulerHarness, request_id: str) -> list[tuple[int, bool]]:
    return [
        (d.num_tokens, d.samples) for d in h.dispatches if d.request_id == request_id
    ]


def spend_the_burst(h: SchedulerHarness, user: str) -> None:
    h.add(user, max_tokens=1)
    h.add(user, max_tokens=1)
    h.step(1 * MS)


# ----- hybrid models ---------------------------------------------------------


def test_a_hybrid_prefill_never_stops_off_a_mamba_block_boundary(limited) -> None:
    # vLLM caches Mamba state at block boundaries (64 tokens here): a chunk
    # that stops short of the prompt's end must end on one. vLLM's own
    # chunks of this 500-token prompt end at 128, 256, 384 and 448; the last
    # one, 448-500, samples. Without budget it must not be held back to 499
    # (the last position before sampling, off a boundary): it waits whole.
    h = limited(2, hybrid=True, max_num_batched_tokens=128)
    late = h.add("a", prompt_len=500, max_tokens=2)
    h.add("a", max_tokens=1)  # takes the budget in the first step
    h.run_until_done(10 * MS)
    assert chunks(h, late.request_id) == [
        (128, False),
        (128, False),
        (128, False),
        (64, False),
        (52, True),
        (1, True),
    ]
    assert h.sampled_by_request(late.request_id)[0] >= 1_400 * MS  # it waited


def test_a_hybrid_prompt_within_one_block_waits_whole(limited) -> None:
    h = limited(2, hybrid=True)
    spend_the_burst(h, "a")
    late = h.add("a", prompt_len=HYBRID_BLOCK_SIZE - 10, max_tokens=1)
    behind = h.add("b", prompt_len=20, max_tokens=1)
    h.step(1 * MS)
    # No boundary to stop at before sampling: it is not admitted while
    # throttled, and does not keep the request behind it waiting.
    assert [d.request_id for d in h.dispatches if d.step == h.steps] == [
        behind.request_id
    ]
    h.run_until_done(10 * MS)
    assert chunks(h, late.request_id) == [(HYBRID_BLOCK_SIZE - 10, True)]


def test_on_cpu_a_seeded_request_is_never_held_back_partway(limited) -> None:
    # vLLM rewinds a seeded request's generator after a chunk that does not
    # sample, and a CPU generator cannot be rewound: the engine would die
    # (reproduced end to end with a seed and speculative decoding). So on
    # CPU, a throttled seeded request waits whole, while an unseeded one is
    # still prefilled up to its sampling position.
    for seed, expected in ((7, [(100, True)]), (None, [(99, False), (1, True)])):
        h = limited(2)
        spend_the_burst(h, "a")
        late = h.add("a", prompt_len=100, max_tokens=1, seed=seed)
        h.step(1 * MS)
        h.run_until_done(10 * MS)
        assert chunks(h, late.request_id) == expected, seed


def test_a_throttled_hybrid_request_keeps_its_state_blocks(limited) -> None:
    h = limited(1, {"b": 1000}, hybrid=True, max_num_seqs=4, max_num_active_seqs=1)
    throttled = h.add("a", prompt_len=100, max_tokens=30)
    h.step(1 * MS)
    h.step(1 * MS)
    manager = h.scheduler.kv_cache_manager
    blocks = manager.get_block_ids(throttled.request_id)
    assert len(blocks) == 2  # an attention group and a Mamba group
    other = h.add("b", prompt_len=40, max_tokens=20)
    for _ in range(22):  # 5 ms steps: a gets no token meanwhile
        h.step(5 * MS)
    assert len(h.outputs[other.request_id]) == 20  # b ran beside it
    assert throttled.request_id not in h.finished
    assert manager.get_block_ids(throttled.request_id) == blocks
    h.run_until_done(50 * MS)
    assert len(h.outputs[throttled.request_id]) == 30


def test_hybrid_limits_that_do_not_bind_change_nothing(
    tiny_model_path: str, is_async: bool, limited
) -> None:
    def workload(h: SchedulerHarness) -> list[tuple[int, str, int, bool]]:
        for i in range(8):
            h.add(f"user-{i % 3}", prompt_len=5 + 61 * i % 400, max_tokens=10 + i)
        h.run_until_done(1 * MS)
        return [(d.step, d.request_id, d.num_tokens, d.samples) for d in h.dispatches]

    kwargs = {"hybrid": True, "max_num_batched_tokens": 200}
    stock = make_scheduler(tiny_model_path, limits=None, is_async=is_async, **kwargs)
    ours = limited(1e6, fair_step_tokens=False, **kwargs)
    assert workload(ours) == workload(stock)


# ----- multimodal models ------------------------------------------------------


def encoder_runs(h: SchedulerHarness) -> Counter[str]:
    """How often each request's encoder inputs were scheduled."""
    return Counter(h.encoder_scheduled)


def test_a_held_back_prompt_ending_in_an_image_runs_its_encoder_once(
    limited,
) -> None:
    # The image covers the last 30 prompt positions, the sampling position
    # among them: the hold-back splits it (chunked multimodal input), and
    # the encoder output stays cached for the last position.
    h = limited(2, encoder_budget=400)
    spend_the_burst(h, "a")
    late = h.add("a", prompt_len=100, max_tokens=2, mm_placeholders=[(70, 30)])
    h.run_until_done(10 * MS)
    assert chunks(h, late.request_id)[:2] == [(99, False), (1, True)]
    assert encoder_runs(h)[late.request_id] == 1
    assert len(h.outputs[late.request_id]) == 2


def test_without_chunked_mm_input_an_image_is_never_split(limited) -> None:
    # 72 tokens a step: 64 of the prompt, and 8 of a request that takes the
    # user's budget. The image's chunk, 64-100, samples: without budget it
    # can neither be held back inside the image nor stop before it (the
    # encoder run planned for the chunk would be wasted), so it waits whole,
    # and the encoder runs once.
    h = limited(
        2,
        encoder_budget=400,
        disable_chunked_mm_input=True,
        max_num_batched_tokens=72,
        long_prefill_token_threshold=64,
    )
    late = h.add("a", prompt_len=100, max_tokens=2, mm_placeholders=[(70, 30)])
    h.add("a", max_tokens=1)
    h.run_until_done(10 * MS)
    assert chunks(h, late.request_id) == [(64, False), (36, True), (1, True)]
    assert h.sampled_by_request(late.request_id)[0] >= 1_400 * MS  # it waited
    assert encoder_runs(h)[late.request_id] == 1


def test_an_image_only_prompt_waits_queued_without_blocking(limited) -> None:
    h = limited(2, encoder_budget=400, disable_chunked_mm_input=True)
    spend_the_burst(h, "a")
    late = h.add("a", prompt_len=40, max_tokens=1, mm_placeholders=[(0, 40)])
    behind = h.add("b", prompt_len=20, max_tokens=1)
    h.step(1 * MS)
    assert behind.request_id in {d.request_id for d in h.dispatches}
    h.run_until_done(10 * MS)
    assert chunks(h, late.request_id) == [(40, True)]
    assert encoder_runs(h)[late.request_id] == 1


def test_throttled_multimodal_requests_never_rerun_their_encoders(limited) -> None:
    h = limited(5, {"b": 1000}, encoder_budget=300, max_num_batched_tokens=128)
    images = [
        h.add("a", prompt_len=200, max_tokens=20, mm_placeholders=[(20, 60), (100, 60)])
        for _ in range(3)
    ]
    for _ in range(3):
        h.add("b", prompt_len=150, max_tokens=20, mm_placeholders=[(10, 100)])
    h.run_until_done(5 * MS)
    for request in images:
        assert encoder_runs(h)[request.request_id] == 2  # one run per image
        assert len(h.outputs[request.request_id]) == 20
    assert_bound(h.sampled_at("a"), 5)


# ----- LoRA ----------------------------------------------------------------------


def test_a_throttled_lora_user_cannot_crash_the_engine(limited) -> None:
    # vLLM 0.32 checks --max-loras against the adapters scheduled in a step;
    # a throttled resident is not scheduled, so an adapter admitted beside
    # it would make a later step exceed the limit (vLLM asserts: the engine
    # dies). Resident adapters count, as vLLM 0.33 counts them.
    h = limited(1000, {"a": 2}, max_loras=1, max_num_seqs=8)
    for _ in range(2):
        h.add("a", max_tokens=30, lora=1)
    for _ in range(3):
        h.step(1 * MS)
    other = h.add("b", max_tokens=100, lora=2)
    for _ in range(200):
        h.step(10 * MS)
        adapters = {r.lora_request.lora_int_id for r in h.scheduler.running}
        assert len(adapters) <= 1
    h.run_until_done(10 * MS)
    assert len(h.outputs[other.request_id]) == 100


def test_lora_users_with_budget_run_beside_a_throttled_adapter(limited) -> None:
    h = limited(1000, {"a": 2}, max_loras=2, max_num_seqs=8)
    for _ in range(2):
        h.add("a", max_tokens=30, lora=1)
    h.step(1 * MS)
    other = h.add("b", max_tokens=50, lora=2)
    for _ in range(52):  # 10 ms steps: a gets a token every 50 steps
        h.step(10 * MS)
    assert len(h.outputs[other.request_id]) == 50
    assert_bound(h.sampled_at("a"), 2)


# ----- pipeline parallelism: several batches in flight ---------------------------


@pytest.mark.parametrize("in_flight", [1, 3])
def test_batches_in_flight_keep_the_bound_and_the_accounts(
    limited, in_flight: int
) -> None:
    # vLLM's scheduler with pipeline parallelism: up to `in_flight` batches
    # are executing while the next one is scheduled (a request is in at most
    # one of them, synchronous scheduling; async schedules it again).
    rates = {"a": 7, "b": 40, "c": 1000}
    h = limited(10, rates, in_flight=in_flight, max_num_seqs=16, num_blocks=200)
    for user in rates:
        for _ in range(4):
            h.add(user, prompt_len=60, max_tokens=80)
    for _ in range(400):
        h.step(5 * MS)
    for user, rate in rates.items():
        assert_bound(h.sampled_at(user), rate)
    # The fast user is not held up by the throttled ones.
    assert all(len(h.outputs[r]) == 80 for r, u in h.users.items() if u == "c")


# ----- KV connectors: a prefill/decode-disaggregated decode instance -------------


def test_a_decode_instance_charges_what_it_samples_and_blocks_nobody(
    limited,
) -> None:
    # DecodeBenchConnector's scheduler side, for real: every request arrives
    # with its prompt's KV computed elsewhere but the last token, as on the
    # decode instance of a P/D pair. Its first chunk samples: a throttled
    # user's request is left queued (vLLM 0.32 would stop its scan at it)
    # and the requests behind it are admitted.
    h = limited(4, {"b": 1000}, kv_connector="DecodeBenchConnector")
    throttled = [h.add("a", prompt_len=300, max_tokens=6) for _ in range(3)]
    h.step(1 * MS)
    behind = [h.add("b", prompt_len=300, max_tokens=6) for _ in range(3)]
    for _ in range(12):
        h.step(2 * MS)
    for request in behind:
        assert len(h.outputs[request.request_id]) == 6
        # Only the last prompt token and the decode steps ran here.
        assert chunks(h, request.request_id)[0] == (1, True)
    h.run_until_done(20 * MS)
    for request in throttled:
        assert len(h.outputs[request.request_id]) == 6
    assert_bound(h.sampled_at("a"), 4)
