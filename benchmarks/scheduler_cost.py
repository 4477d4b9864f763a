"""The cost of one scheduler step at scale, ours against stock vLLM.

vLLM's real V1 scheduler and KV cache manager without a model (the tests'
harness, ``tests/harness/scheduler_sim.py``): ``R`` resident requests spread
round-robin over ``U`` users, prefilled, then timed in steady decoding with
ours held in one state for the whole measurement (``STATES``):

* ``a``: no limit binds (every user may take 1e9 tok/s);
* ``b``: every user throttled (1e-3 tok/s: after its first token a user's
  next is due 1000 s later, long after the run);
* ``c``: every other user throttled, so half the requests decode;
* ``r``: as ``a``, on the reference path (``"shortcuts": false``): what
  the shortcuts save (``scheduling/shortcuts.py``), reported.

Stock vLLM decodes all ``R`` requests in every state, with the same
configuration. All schedulers of one ``R`` are stepped side by side in
rounds, in a shuffled order; a ratio is the median over rounds of ours /
stock in the same round. Every timed step checks that it measured the state
claimed (how many requests were scheduled, none of a throttled user's);
after the rounds, a few more steps count the limiter's calls.

Alone (prints the report's section)::

    PYTHONPATH=tests:. python -m benchmarks.scheduler_cost [--quick]
        [--figures DIR] [--json PATH] [--scheduler MODULE:CLASS]

``--scheduler`` measures another class as "ours" (e.g. a candidate fix).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.measure import median_us
from benchmarks.report import scheduler_cost as report
from harness.counting_limiter import CountingLimiter
from vllm_output_rate.limiter import OutputRateLimiter

STATES: dict[str, str] = {
    "a": "no limit binds",
    "b": "all users throttled",
    "c": "half the users throttled",
    "r": "no limit binds, reference path (shortcuts off)",
}
FULL_SIZES, QUICK_SIZES = (64, 256, 1024, 4096), (64, 256)
USER_COUNTS = (1, 16, 256)
# Timed rounds per R (each round steps every scheduler of that R once).
FULL_ROUNDS = {64: 400, 256: 300, 1024: 150, 4096: 60}
QUICK_ROUNDS = {64: 60, 256: 40, 1024: 20, 4096: 10}
SEED = 20240601
FIVE_PERCENT = 1.05
HUGE_RATE, TINY_RATE = 1e9, 1e-3  # tok/s: never binds; a token per 1000 s
STEP_NS = 1_000_000  # the harness clock advances this much per step
PROMPT_MIN, PROMPT_SPREAD = 8, 16  # prompt lengths 8..23: blocks spread out
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
    calls: Counter[str] = field(default_factory=Counter)


def _prompt(k: int) -> list[int]:
    """A prompt unique to request ``k`` (no prefix-cache sharing)."""
    length = PROMPT_MIN + k % PROMPT_SPREAD
    head = [10 + k % 390, 10 + (k // 390) % 390]
    return (head + [10 + (k * 7 + j * 13) % 390 for j in range(length)])[:length]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def step(harness: Any) -> tuple[Any, int, int]:
    """One step with a synthetic model output: (output, ns in schedule() and
    get_grammar_bitmask(), which vLLM's engine calls next and where ours
    settles the step, ns in update_from_output())."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler = harness.scheduler
    harness.clock.advance(STEP_NS)
    t0 = time.perf_counter_ns()
    output = scheduler.schedule()
    scheduler.get_grammar_bitmask(output)
    t1 = time.perf_counter_ns()
    req_ids = list(output.num_scheduled_tokens)
    model_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[
            [] if scheduler.requests[rid].is_prefill_chunk else [SAMPLED_TOKEN]
            for rid in req_ids
        ],
    )
    t2 = time.perf_counter_ns()
    scheduler.update_from_output(output, model_output)
    return output, t1 - t0, time.perf_counter_ns() - t2


def check_state(subject: Subject, output: Any, num_requests: int) -> None:
    scheduler = subject.harness.scheduler
    what = f"R={num_requests} U={subject.users} state={subject.state or 'stock'}"
    scheduled = output.num_scheduled_tokens
    _check(len(scheduler.running) == num_requests, f"{what}: a request left")
    _check(not output.preempted_req_ids, f"{what}: preemption")
    _check(
        len(scheduled) == subject.expect_scheduled,
        f"{what}: {len(scheduled)} scheduled, expected {subject.expect_scheduled}",
    )
    _check(
        output.total_num_scheduled_tokens == len(scheduled),
        f"{what}: not a pure decode step",
    )
    _check(
        not subject.throttled_users
        or all(
            scheduler.requests[rid].output_rate_user not in subject.throttled_users
            for rid in scheduled
        ),
        f"{what}: a throttled user's request was dispatched",
    )
    subject.scheduled.append(len(scheduled))


def make_subjects(
    model_path: str,
    num_requests: int,
    user_counts: Sequence[int],
    rounds: int,
    scheduler_cls: type | None = None,
) -> list[Subject]:
    """Stock, and ours in each state for each U, with R requests added."""
    from harness.scheduler_sim import BLOCK_SIZE, make_scheduler

    prompt_max = PROMPT_MIN + PROMPT_SPREAD - 1
    max_tokens = 1 + WARMUP_DECODE_STEPS + SETTLE_STEPS + rounds + COUNTED_STEPS + 16
    common = dict(
        num_blocks=num_requests * (-(-(prompt_max + max_tokens) // BLOCK_SIZE) + 1)
        + 64,
        max_num_seqs=num_requests,
        # The whole prefill fits in one step; decoding never hits the budget.
        max_num_batched_tokens=max(2048, num_requests * prompt_max),
    )
    limits = {"default_user_output_tokens_per_second": HUGE_RATE}
    subjects = [
        Subject(
            None, 0, make_scheduler(model_path, limits=None, **common), num_requests
        )
    ]
    for users in (u for u in user_counts if u <= num_requests):
        for state in STATES:
            if state == "c" and users < 2:
                continue  # half of one user is not a state
            throttled = frozenset(
                f"user-{u}"
                for u in range(users)
                if state == "b" or (state == "c" and u % 2 == 1)
            )
            harness = make_scheduler(
                model_path,
                limits={**limits, "shortcuts": state != "r"},
                scheduler_cls=scheduler_cls,
                **common,
            )
            expect = num_requests - num_requests // users * len(throttled)
            subjects.append(Subject(state, users, harness, expect, throttled))
    for subject in subjects:
        for k in range(num_requests):
            user = f"user-{k % max(subject.users, 1)}"
            subject.harness.add(user, prompt=_prompt(k), max_tokens=max_tokens)
    return subjects


def warm_up(subject: Subject, num_requests: int) -> None:
    """Prefill everything, decode a little, then enter the subject's state."""
    scheduler = subject.harness.scheduler
    step(subject.harness)
    _check(
        len(scheduler.running) == num_requests and not scheduler.waiting,
        "prefill did not admit every request in one step",
    )
    for _ in range(WARMUP_DECODE_STEPS):
        output, _, _ = step(subject.harness)
        _check(len(output.num_scheduled_tokens) == num_requests, "warm-up decode")
    if subject.state is not None:
        # The limiter reads the real clock, as in production (a fake clock
        # would add a Python call to every limiter call).
        subject.limiter = OutputRateLimiter(
            TINY_RATE if subject.state == "b" else HUGE_RATE,
            dict.fromkeys(sorted(subject.throttled_users), TINY_RATE)
            if subject.state == "c"
            else None,
        )
        scheduler.output_rate.use_limiter(subject.limiter)
        for _ in range(SETTLE_STEPS):
            step(subject.harness)


def _measure_size(
    model_path: str,
    num_requests: int,
    user_counts: Sequence[int],
    rounds: int,
    rng: random.Random,
    scheduler_cls: type | None,
) -> list[Subject]:
    subjects = make_subjects(
        model_path, num_requests, user_counts, rounds, scheduler_cls
    )
    for subject in subjects:
        warm_up(subject, num_requests)
    # Like vLLM's engine after start-up: long-lived objects leave the GC's view.
    gc.collect()
    gc.freeze()
    try:
        order = list(subjects)
        for _ in range(rounds):
            rng.shuffle(order)
            for subject in order:
                output, schedule_ns, update_ns = step(subject.harness)
                subject.schedule_ns.append(schedule_ns)
                subject.update_ns.append(update_ns)
                check_state(subject, output, num_requests)
    finally:
        gc.unfreeze()
    for subject in subjects:
        if subject.limiter is not None:
            counting = CountingLimiter.count_calls(subject.limiter)
            for _ in range(COUNTED_STEPS):
                check_state(subject, step(subject.harness)[0], num_requests)
            subject.calls = counting.calls
    return subjects


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _rows(subjects: list[Subject], num_requests: int) -> tuple[dict, list]:
    stock = subjects[0]
    stock_row = {
        "R": num_requests,
        "schedule_us": median_us(stock.schedule_ns),
        "update_us": median_us(stock.update_ns),
        "scheduled_per_step": statistics.mean(stock.scheduled),
    }
    rows = []
    for subject in subjects[1:]:
        ratios = [
            ours / theirs
            for ours, theirs in zip(subject.schedule_ns, stock.schedule_ns, strict=True)
        ]
        q1, q3 = _quartiles(ratios)
        scheduled = statistics.mean(subject.scheduled)
        rows.append(
            {
                "state": subject.state,
                "R": num_requests,
                "U": subject.users,
                "ours_us": median_us(subject.schedule_ns),
                "stock_us": stock_row["schedule_us"],
                "ratio": statistics.median(ratios),
                "ratio_q1": q1,
                "ratio_q3": q3,
                "ours_update_us": median_us(subject.update_ns),
                "stock_update_us": stock_row["update_us"],
                "limiter_calls_per_step": sum(subject.calls.values()) / COUNTED_STEPS,
                "scheduled_per_step": scheduled,
                "throttled_per_step": num_requests - scheduled,
                "steps": len(subject.schedule_ns),
            }
        )
    return stock_row, rows


def _evaluate(rows: list[dict]) -> dict[str, Any]:
    growth: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        per_u = growth.setdefault(row["state"], {})
        per_u.setdefault(str(row["U"]), []).append(row["limiter_calls_per_step"])
    # Same U, any R: the same limiter calls per step (the periodic cleanup
    # may add a fraction of a call).
    flat = all(
        max(calls) - min(calls) <= 1
        for per_u in growth.values()
        for calls in per_u.values()
    )
    worst = {
        state: max((r["ratio"] for r in rows if r["state"] == state), default=math.nan)
        for state in ("a", "b", "r")
    }
    return {
        "a_within_5_percent_of_stock": {
            "met": worst["a"] <= FIVE_PERCENT,
            "worst_ratio": worst["a"],
            "limit": FIVE_PERCENT,
        },
        "limiter_calls_grow_with_U_not_R": {
            "met": flat,
            "calls_per_step_by_state_and_U": growth,
        },
        "b_not_above_stock": {
            "met": worst["b"] <= 1.0,
            "worst_ratio": worst["b"],
            "limit": 1.0,
        },
        # Reported, not judged: the same decisions without the shortcuts.
        "r_reference_path": {"met": None, "worst_ratio": worst["r"]},
    }


def run(
    quick: bool = False,
    *,
    sizes: Sequence[int] | None = None,
    user_counts: Sequence[int] = USER_COUNTS,
    rounds: int | None = None,
    model_path: str | None = None,
    scheduler_cls: type | None = None,
) -> dict[str, Any]:
    """Measure every configuration; ``sizes`` (values of R), ``rounds`` and
    ``model_path`` default to the quick or full settings and the tiny model,
    ``scheduler_cls`` to ``OutputRateScheduler``."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    started = time.perf_counter()
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    table = QUICK_ROUNDS if quick else FULL_ROUNDS
    model_path = model_path or str(build_tiny_model())
    rng = random.Random(SEED)
    stock_rows: list[dict] = []
    rows: list[dict] = []
    rounds_used: dict[str, int] = {}
    for num_requests in sizes:
        n = rounds if rounds is not None else table.get(num_requests, 20)
        rounds_used[str(num_requests)] = n
        subjects = _measure_size(
            model_path, num_requests, user_counts, n, rng, scheduler_cls
        )
        stock_row, size_rows = _rows(subjects, num_requests)
        stock_rows.append(stock_row)
        rows.extend(size_rows)
        del subjects
        gc.collect()
    return {
        "meta": {
            "quick": quick,
            "sizes": list(sizes),
            "states": dict(STATES),
            "user_counts": list(user_counts),
            "rounds": rounds_used,
            "scheduler": (
                f"{scheduler_cls.__module__}:{scheduler_cls.__qualname__}"
                if scheduler_cls
                else "vllm_output_rate.scheduling.scheduler:OutputRateScheduler"
            ),
            "elapsed_s": time.perf_counter() - started,
        },
        "stock": stock_rows,
        "rows": rows,
        "targets": _evaluate(rows),
    }


def _load_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(f"expected MODULE:CLASS, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduler_cost")
    parser.add_argument("--quick", action="store_true", help="fewer R and rounds")
    parser.add_argument("--figures", type=Path, help="also write the figure here")
    parser.add_argument("--json", type=Path, help="also write the raw results")
    parser.add_argument("--scheduler", type=_load_class, metavar="MODULE:CLASS")
    args = parser.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout
        results = run(quick=args.quick, scheduler_cls=args.scheduler)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(report.section(results, args.figures, Path.cwd()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
