"""Prompt-token rates per user (``prompt_budget.py``) on vLLM's real
scheduler, sync and async, with a fake clock: the window bound on prompt
tokens computed, progress of prompts far larger than the burst, users
without a binding prompt rate left alone, the statistics' count of prompt
tokens computed, and the accounting invariant (checked for every test by the
``limited`` fixture)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from harness.bounds import MS, S, assert_window_bound
from vllm_output_rate.scheduling.prompt_budget import MIN_PROMPT_CHUNK
from vllm_output_rate.scheduling.settling import CLEANUP_EVERY_STEPS

STEP_NS = 10 * MS
FAR = 1e6  # tok/s: an output or prompt rate that never binds


def test_prompts_far_larger_than_the_burst_progress_at_the_rate(limited) -> None:
    # 2,000 prompt tokens a second: a burst of 200. Each 900-token prompt
    # takes ~0.45 s; 6 of them ~2.7 s, however many steps the engine runs.
    h = limited(FAR, prompt={"default": 2_000.0}, max_num_batched_tokens=512)
    for _ in range(6):
        h.add("batch", prompt_len=900, max_tokens=4)
    h.run_until_done(STEP_NS)
    times = h.prompt_token_times("batch")
    assert len(times) == 6 * 899
    assert_window_bound(times, 2_000.0)
    took_s = (times[-1] - times[0]) / S
    assert 6 * 899 / 2_000 - 0.2 <= took_s <= 6 * 899 / 2_000 + 0.2
    assert all(len(out) == 4 for out in h.outputs.values())  # nothing cut
    # Steps of at least MIN_PROMPT_CHUNK of its prompt tokens, not a few in
    # every step: it waits for its rate to allow them (a prompt's last
    # chunk may be shorter).
    steps = {d.step for d in h.dispatches if d.num_tokens > 1 or not d.samples}
    assert len(steps) <= len(times) / MIN_PROMPT_CHUNK + 6, len(steps)


def test_a_rate_whose_burst_is_less_than_a_chunk_still_progresses(limited) -> None:
    # 100 tok/s: at most 11 tokens at once, fewer than MIN_PROMPT_CHUNK.
    h = limited(FAR, prompt={"default": 100.0}, max_num_batched_tokens=512)
    h.add("slow", prompt_len=301, max_tokens=2)
    h.run_until_done(STEP_NS)
    times = h.prompt_token_times("slow")
    assert len(times) == 300
    assert_window_bound(times, 100.0)
    assert (times[-1] - times[0]) / S == pytest.approx(3.0 - 0.1, abs=0.15)


@pytest.mark.parametrize("seed", range(4))
def test_the_window_bound_holds_for_every_user(limited, seed: int) -> None:
    rng = random.Random(seed)
    rates = {"a": 1_500.0, "b": 4_000.0, "c": 700.0}
    h = limited(
        FAR,
        prompt={"default": 3_000.0, **rates},
        max_num_seqs=8,
        max_num_batched_tokens=rng.choice([256, 512, 1024]),
    )
    for step in range(400):
        if step % 7 == 0 and len(h.scheduler.requests) < 24:
            user = rng.choice([*rates, "d"])
            h.add(user, prompt_len=rng.randint(20, 1_500), max_tokens=rng.randint(1, 8))
        h.step(STEP_NS)
    h.run_until_done(STEP_NS)
    for user, rate in {**rates, "d": 3_000.0}.items():
        times = h.prompt_token_times(user)
        if times:
            assert_window_bound(times, rate)


def test_a_user_within_its_prompt_rate_is_not_held_back(limited) -> None:
    # The hog's prompts go at 1,000 tok/s; the light user's rate is far
    # above what it sends: its requests run as with no prompt rate at all.
    h = limited(
        FAR,
        prompt={"default": FAR, "hog": 1_000.0},
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    light_steps = []
    for _ in range(8):
        h.add("hog", prompt_len=600, max_tokens=1)
    for _ in range(10):
        request = h.add("light", prompt_len=40, max_tokens=4)
        added = h.steps
        while request.request_id not in h.finished:
            h.step(STEP_NS)
        light_steps.append(h.steps - added)
    h.run_until_done(STEP_NS)
    # Its prompt in one step and a token a step after it (async: one step
    # more for the output in flight).
    assert max(light_steps) <= 4 + 2, str(light_steps)
    assert_window_bound(h.prompt_token_times("hog"), 1_000.0)


def test_prefix_cache_hits_are_free(limited) -> None:
    h = limited(FAR, prompt={"default": 1_000.0}, max_num_batched_tokens=512)
    shared = list(range(1, 481))
    h.add("cached", prompt=shared, max_tokens=2)
    h.run_until_done(STEP_NS)
    before = Counter(h.prompt_token_times("cached"))
    h.add("cached", prompt=[*shared, 7, 8, 9], max_tokens=2)
    h.run_until_done(STEP_NS)
    computed = len(h.prompt_token_times("cached")) - sum(before.values())
    # Only what the cache did not hold is computed, and charged (the
    # fixture's accounting check).
    assert computed < 64, computed


def test_users_that_left_are_forgotten(limited) -> None:
    # Like the output limiter's: a user whose prompt budget is back to full
    # is dropped at the periodic cleanup, so state does not grow with every
    # user ever seen.
    h = limited(FAR, prompt={"default": 2_000.0}, max_num_batched_tokens=512)
    for i in range(20):
        h.add(f"once-{i}", prompt_len=300, max_tokens=1)
    h.run_until_done(STEP_NS)
    prompt_limiter = h.scheduler.output_rate.prompt_limiter
    assert len(prompt_limiter) > 0
    for _ in range(CLEANUP_EVERY_STEPS):
        h.step(STEP_NS)
    assert len(prompt_limiter) == 0


def test_the_statistics_count_the_prompt_tokens_computed(limited) -> None:
    # Prefill under binding prompt rates, recomputation after the plugin
    # takes a slot back (two slots, five users at 5 tok/s: time-shared)
    # and a prefix-cache hit (free): each user's prompt tokens on record,
    # in its admin view and under its metrics label, are those computed
    # (and charged: the fixture's check).
    users = {f"u{i}": 5.0 for i in range(5)}
    h = limited(
        1_000.0,
        users,
        prompt={"default": 2_000.0, "u0": 100.0},
        max_num_seqs=2,
        max_num_batched_tokens=512,
    )
    shared = list(range(1, 321))
    h.add("u0", prompt=shared, max_tokens=4)
    for user in users:
        h.add(user, prompt_len=200, max_tokens=8)
    h.run_until_done(STEP_NS)
    h.add("u0", prompt=[*shared, 7, 8], max_tokens=2)
    h.run_until_done(STEP_NS)
    assert h.preemptions > 0
    policy = h.scheduler.output_rate
    computed = {user: len(h.prompt_token_times(user)) for user in users}
    u0_times = h.prompt_token_times("u0")
    # u0's rate binds: ~520 tokens at 100 tok/s (the others' prompts take
    # under 2 s).
    assert (u0_times[-1] - u0_times[0]) / S > 4.0
    on_record, _, _ = policy.stats.users_page(h.clock.now_ns, 100)
    assert {u: view["prompt_tokens"] for u, view in on_record.items()} == computed
    labels = policy.metrics_snapshot()["labels"]
    assert {u: labels[u]["prompt_tokens"] for u in users} == computed
    # The prompts once (but a prompt's last token, which samples), the
    # tokens computed again after a preemption, and of the cached prompt's
    # second request only the token past its cached blocks.
    recomputed = {u: labels[u]["recomputed_tokens"] for u in users}
    assert sum(recomputed.values()) > 0
    firsts = {u: 199 for u in users} | {"u0": 319 + 199 + 1}
    assert computed == {u: firsts[u] + recomputed[u] for u in users}
