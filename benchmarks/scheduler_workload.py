"""The workload the scheduler-cost benchmark times (``scheduler_cost``).

``make_subjects`` builds, for one number ``R`` of resident requests, stock
vLLM's scheduler and ours in each state (``STATES``) for each user count
``U``: vLLM's real V1 scheduler and KV cache manager without a model (see
``tests/harness/scheduler_sim.py``), ``R`` requests spread round-robin over
``U`` users. ``warm_up`` prefills them, decodes a little and puts ours in
its state, held for the whole measurement:

* ``a``: no limit binds (every user may take 1e9 tok/s);
* ``b``: every user is throttled (1e-3 tok/s: after its first token a user's
  next one is due 1000 s later, long after the run);
* ``c``: every other user is throttled, so half the requests decode.

``step`` runs one scheduler step with a synthetic model output and times
``schedule()`` and ``update_from_output()``; ``check_state`` checks that the
step measured the claimed state (how many requests were dispatched and how
many were skipped as throttled, and that no throttled user's request ran);
``count_limiter_calls`` counts the limiter's calls over a few more steps.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.counting_limiter import CountingLimiter
from vllm_output_rate.limiter import OutputRateLimiter

STATES: dict[str, str] = {
    "a": "no limit binds",
    "b": "all users throttled",
    "c": "half the users throttled",
}
HUGE_RATE = 1e9  # tok/s: never binds
TINY_RATE = 1e-3  # tok/s: one token per 1000 s
STEP_NS = 1_000_000  # the harness clock (warm-up limiter) advances per step
PROMPT_MIN = 8
PROMPT_SPREAD = 16  # prompt lengths 8..23, so block boundaries are spread out
WARMUP_DECODE_STEPS = 3
SETTLE_STEPS = 2  # after switching to the state's limiter
COUNTED_STEPS = 8  # untimed steps that count limiter calls, after the rounds
SAMPLED_TOKEN = 42


@dataclass
class Subject:
    """One scheduler under measurement: stock, or ours in one state for one U."""

    state: str | None  # None for stock
    users: int
    harness: Any  # SchedulerHarness
    expect_scheduled: int
    throttled_users: frozenset[str] = frozenset()
    limiter: OutputRateLimiter | None = None
    schedule_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    scheduled: list[int] = field(default_factory=list)
    throttled: list[int] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)


def _user_name(index: int) -> str:
    return f"user-{index}"


def _prompt(k: int) -> list[int]:
    """A prompt unique to request ``k`` (no prefix-cache sharing)."""
    length = PROMPT_MIN + k % PROMPT_SPREAD
    head = [10 + k % 390, 10 + (k // 390) % 390]
    return (head + [10 + (k * 7 + j * 13) % 390 for j in range(length)])[:length]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _synthetic_output(scheduler: Any, output: Any) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [
        [] if requests[rid].is_prefill_chunk else [SAMPLED_TOKEN] for rid in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(harness: Any) -> tuple[Any, int, int]:
    """One step: (output, ns in schedule() and get_grammar_bitmask(), which
    vLLM's engine calls next and where ours settles the step, ns in
    update_from_output())."""
    scheduler = harness.scheduler
    harness.clock.advance(STEP_NS)
    t0 = time.perf_counter_ns()
    output = scheduler.schedule()
    scheduler.get_grammar_bitmask(output)
    t1 = time.perf_counter_ns()
    model_output = _synthetic_output(scheduler, output)
    t2 = time.perf_counter_ns()
    scheduler.update_from_output(output, model_output)
    t3 = time.perf_counter_ns()
    return output, t1 - t0, t3 - t2


def check_state(subject: Subject, output: Any, num_requests: int) -> None:
    scheduler = subject.harness.scheduler
    what = f"R={num_requests} U={subject.users} state={subject.state or 'stock'}"
    scheduled = output.num_scheduled_tokens
    _check(
        len(scheduler.running) == num_requests,
        f"{what}: {len(scheduler.running)} resident, expected {num_requests}",
    )
    _check(not output.preempted_req_ids, f"{what}: preemption")
    _check(not output.finished_req_ids, f"{what}: a request finished")
    _check(
        len(scheduled) == subject.expect_scheduled,
        f"{what}: {len(scheduled)} scheduled, expected {subject.expect_scheduled}",
    )
    _check(
        output.total_num_scheduled_tokens == len(scheduled),
        f"{what}: not a pure decode step",
    )
    if subject.state is not None:
        throttled = len(scheduler.output_rate.throttled)
        _check(
            throttled == num_requests - subject.expect_scheduled,
            f"{what}: {throttled} skipped as throttled",
        )
        requests = scheduler.requests
        _check(
            all(
                requests[rid].output_rate_user not in subject.throttled_users
                for rid in scheduled
            ),
            f"{what}: a throttled user's request was dispatched",
        )
        subject.throttled.append(throttled)
    subject.scheduled.append(len(scheduled))


def make_subjects(
    model_path: str,
    num_requests: int,
    user_counts: Sequence[int],
    rounds: int,
    scheduler_cls: type | None = None,
) -> list[Subject]:
    from harness.scheduler_sim import BLOCK_SIZE, make_scheduler

    prompt_max = PROMPT_MIN + PROMPT_SPREAD - 1
    max_tokens = 1 + WARMUP_DECODE_STEPS + SETTLE_STEPS + rounds + COUNTED_STEPS + 16
    blocks_per_request = -(-(prompt_max + max_tokens) // BLOCK_SIZE) + 1
    common = dict(
        num_blocks=num_requests * blocks_per_request + 64,
        max_num_seqs=num_requests,
        # The whole prefill fits in one step; decoding never hits the budget.
        max_num_batched_tokens=max(2048, num_requests * prompt_max),
    )
    limits = {"default_user_output_tokens_per_second": HUGE_RATE}
    subjects = [
        Subject(
            None,
            0,
            make_scheduler(model_path, limits=None, **common),
            expect_scheduled=num_requests,
        )
    ]
    for users in user_counts:
        if users > num_requests:
            continue
        for state in STATES:
            if state == "c" and users < 2:
                continue  # half of one user is not a state
            throttled = frozenset(
                _user_name(u)
                for u in range(users)
                if state == "b" or (state == "c" and u % 2 == 1)
            )
            per_user = num_requests // users
            subjects.append(
                Subject(
                    state,
                    users,
                    make_scheduler(
                        model_path,
                        limits=limits,
                        scheduler_cls=scheduler_cls,
                        **common,
                    ),
                    expect_scheduled=num_requests - per_user * len(throttled),
                    throttled_users=throttled,
                )
            )
    for subject in subjects:
        users = max(subject.users, 1)
        for k in range(num_requests):
            subject.harness.add(
                _user_name(k % users), prompt=_prompt(k), max_tokens=max_tokens
            )
    return subjects


def warm_up(subject: Subject, num_requests: int) -> None:
    """Prefill everything, decode a little, then enter the subject's state."""
    harness = subject.harness
    scheduler = harness.scheduler
    output, _, _ = step(harness)
    _check(
        len(scheduler.running) == num_requests and not scheduler.waiting,
        "prefill did not admit every request in one step",
    )
    for _ in range(WARMUP_DECODE_STEPS):
        output, _, _ = step(harness)
        _check(
            len(output.num_scheduled_tokens) == num_requests,
            "warm-up decode did not schedule every request",
        )
    if subject.state is not None:
        # The limiter reads the real clock, as in production (a fake clock
        # would add a Python call to every limiter call). A throttled user's
        # next token is due 1000 s after its first one, long after the run.
        if subject.state == "a":
            limiter = OutputRateLimiter(HUGE_RATE)
        elif subject.state == "b":
            limiter = OutputRateLimiter(TINY_RATE)
        else:
            limiter = OutputRateLimiter(
                HUGE_RATE, dict.fromkeys(sorted(subject.throttled_users), TINY_RATE)
            )
        scheduler.output_rate.use_limiter(limiter)
        subject.limiter = limiter
        for _ in range(SETTLE_STEPS):
            step(harness)


def count_limiter_calls(subject: Subject, num_requests: int) -> None:
    if subject.limiter is None:
        return
    counting = CountingLimiter.count_calls(subject.limiter)
    for _ in range(COUNTED_STEPS):
        output, _, _ = step(subject.harness)
        check_state(subject, output, num_requests)
    subject.calls = counting.calls
