"""Benchmark: the cost of one scheduler step at scale, ours against stock vLLM.

vLLM's real V1 scheduler and KV cache manager run without a model: ``R``
resident requests spread round-robin over ``U`` users, prefilled first, then
timed in a steady decode phase, with ours in one of three states held for the
whole measurement (no limit binds, all users throttled, half of them
throttled; the workload and its checks: ``scheduler_workload``). Stock vLLM
has no notion of throttling, so every state is compared with the stock
scheduler decoding all ``R`` requests, with the same configuration.

The machines this runs on are noisy, so all schedulers of one ``R`` live side
by side and are stepped in rounds: each round takes one timed step of every
scheduler, in a shuffled order. A ratio is the median over rounds of (ours /
stock in the same round); a time is the median over rounds. Every timed step
checks that it measured the claimed state. After the timed rounds, a few
more steps count the limiter's calls. ``run`` returns the results as data;
``benchmarks.report.scheduler_cost`` turns them into Markdown and a figure.

Usage::

    python -m benchmarks.scheduler_cost [--quick] [--plot PATH]
        [--json PATH] [--scheduler MODULE:CLASS]

``--scheduler`` measures another class as "ours" (e.g. a candidate fix).
The command prints the report's section (it is the one measuring module
with a command of its own, for comparing candidate schedulers).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.measure import median_us
from benchmarks.scheduler_workload import (
    COUNTED_STEPS,
    STATES,
    Subject,
    check_state,
    count_limiter_calls,
    make_subjects,
    step,
    warm_up,
)

FULL_SIZES = (64, 256, 1024, 4096)
QUICK_SIZES = (64, 256)
USER_COUNTS = (1, 16, 256)
# Timed rounds per R (each round steps every scheduler of that R once).
FULL_ROUNDS = {64: 400, 256: 300, 1024: 150, 4096: 60}
QUICK_ROUNDS = {64: 60, 256: 40, 1024: 20, 4096: 10}
SEED = 20240601
FIVE_PERCENT = 1.05


def _measure_size(
    model_path: str,
    num_requests: int,
    user_counts: Sequence[int],
    rounds: int,
    rng: random.Random,
    scheduler_cls: type | None = None,
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
        count_limiter_calls(subject, num_requests)
    return subjects


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _rows_for_size(subjects: list[Subject], num_requests: int) -> tuple[dict, list]:
    stock = subjects[0]
    stock_row = {
        "R": num_requests,
        "schedule_us": median_us(stock.schedule_ns),
        "update_us": median_us(stock.update_ns),
        "scheduled_per_step": statistics.mean(stock.scheduled),
    }
    rows = []
    for subject in subjects[1:]:
        steps = len(subject.schedule_ns)
        ratios = [
            ours / theirs
            for ours, theirs in zip(subject.schedule_ns, stock.schedule_ns, strict=True)
        ]
        q1, q3 = _quartiles(ratios)
        calls = subject.calls
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
                "limiter_calls_per_step": sum(calls.values()) / COUNTED_STEPS,
                "limiter_calls_by_method": {
                    name: count / COUNTED_STEPS for name, count in sorted(calls.items())
                },
                "scheduled_per_step": statistics.mean(subject.scheduled),
                "throttled_per_step": statistics.mean(subject.throttled),
                "steps": steps,
            }
        )
    return stock_row, rows


def _evaluate(rows: list[dict]) -> dict[str, Any]:
    a = [r for r in rows if r["state"] == "a"]
    b = [r for r in rows if r["state"] == "b"]
    growth: dict[str, dict[str, list[float]]] = {}
    flat = True
    for row in rows:
        per_r = growth.setdefault(row["state"], {}).setdefault(str(row["U"]), [])
        per_r.append(row["limiter_calls_per_step"])
    for per_u in growth.values():
        for calls in per_u.values():
            # Same U, any R: the same number of limiter calls per step (the
            # periodic cleanup may add a fraction of a call).
            flat = flat and max(calls) - min(calls) <= 1
    worst_a = max((r["ratio"] for r in a), default=math.nan)
    worst_b = max((r["ratio"] for r in b), default=math.nan)
    return {
        "a_within_5_percent_of_stock": {
            "met": bool(a) and worst_a <= FIVE_PERCENT,
            "worst_ratio": worst_a,
            "limit": FIVE_PERCENT,
        },
        "limiter_calls_grow_with_U_not_R": {
            "met": flat,
            "calls_per_step_by_state_and_U": growth,
        },
        "b_not_above_stock": {
            "met": bool(b) and worst_b <= 1.0,
            "worst_ratio": worst_b,
            "limit": 1.0,
        },
    }


def run(
    quick: bool = False,
    *,
    sizes: Sequence[int] | None = None,
    user_counts: Sequence[int] = USER_COUNTS,
    rounds: int | None = None,
    model_path: str | None = None,
    seed: int = SEED,
    scheduler_cls: type | None = None,
) -> dict[str, Any]:
    """Measure every configuration and return the results as data.

    ``sizes`` (values of R), ``rounds`` (timed steps per scheduler) and
    ``model_path`` default to the quick or full settings and the tiny model;
    ``scheduler_cls`` defaults to ``OutputRateScheduler``.
    """
    import vllm

    from vllm_output_rate.demo.tiny_model import build_tiny_model

    started = time.perf_counter()
    if sizes is None:
        sizes = QUICK_SIZES if quick else FULL_SIZES
    table = QUICK_ROUNDS if quick else FULL_ROUNDS
    if model_path is None:
        model_path = str(build_tiny_model())
    rng = random.Random(seed)
    stock_rows: list[dict] = []
    rows: list[dict] = []
    rounds_used: dict[str, int] = {}
    for num_requests in sizes:
        n = rounds if rounds is not None else table.get(num_requests, 20)
        rounds_used[str(num_requests)] = n
        subjects = _measure_size(
            model_path, num_requests, user_counts, n, rng, scheduler_cls
        )
        stock_row, size_rows = _rows_for_size(subjects, num_requests)
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
            "scheduler": _class_name(scheduler_cls),
            "vllm": vllm.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "elapsed_s": time.perf_counter() - started,
        },
        "stock": stock_rows,
        "rows": rows,
        "targets": _evaluate(rows),
    }


def _class_name(cls: type | None) -> str:
    if cls is None:
        return "vllm_output_rate.scheduling.scheduler:OutputRateScheduler"
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(f"expected MODULE:CLASS, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scheduler_cost",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer R values and rounds"
    )
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG plot here")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results")
    parser.add_argument(
        "--scheduler",
        metavar="MODULE:CLASS",
        type=_load_class,
        help="measure this scheduler class as ours (default OutputRateScheduler)",
    )
    args = parser.parse_args(argv)
    # vLLM logs to stdout; keep stdout for the Markdown.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    with contextlib.redirect_stdout(sys.stderr):
        results = run(quick=args.quick, scheduler_cls=args.scheduler)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    from benchmarks.report import scheduler_cost as report

    if args.plot:
        report.plot(results, Path(args.plot))
    print(report.markdown(results, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
