"""Benchmark: the cost of one scheduler step at scale, ours against stock vLLM.

vLLM's real V1 scheduler and KV cache manager run without a model (see
``tests/harness/scheduler_sim.py``): ``R`` resident requests spread round-robin over
``U`` users, prefilled first, then timed in a steady decode phase. Our
scheduler is measured in three states, each held for the whole measurement:

* ``a``: no limit binds (every user may take 1e9 tok/s);
* ``b``: every user is throttled (1e-3 tok/s: after its first token a user's
  next one is due 1000 s later, long after the run);
* ``c``: every other user is throttled, so half the requests decode.

Stock vLLM has no notion of throttling, so every state is compared with the
stock scheduler decoding all ``R`` requests, with the same configuration.

The machines this runs on are noisy, so all schedulers of one ``R`` live side
by side and are stepped in rounds: each round takes one timed step of every
scheduler, in a shuffled order. A ratio is the median over rounds of (ours /
stock in the same round); a time is the median over rounds. Every timed step
checks that it measured the claimed state (how many requests were dispatched
and how many were skipped as throttled, and that no throttled user's request
ran). After the timed rounds, a few more steps count the limiter's calls.

Usage::

    python -m benchmarks.scheduler_cost [--quick] [--plot PATH]
        [--json PATH] [--scheduler MODULE:CLASS]

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
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.counting_limiter import CountingLimiter
from vllm_output_rate.limiter import OutputRateLimiter

STATES: dict[str, str] = {
    "a": "no limit binds",
    "b": "all users throttled",
    "c": "half the users throttled",
}
FULL_SIZES = (64, 256, 1024, 4096)
QUICK_SIZES = (64, 256)
USER_COUNTS = (1, 16, 256)
# Timed rounds per R (each round steps every scheduler of that R once).
FULL_ROUNDS = {64: 400, 256: 300, 1024: 150, 4096: 60}
QUICK_ROUNDS = {64: 60, 256: 40, 1024: 20, 4096: 10}
SEED = 20240601

HUGE_RATE = 1e9  # tok/s: never binds
TINY_RATE = 1e-3  # tok/s: one token per 1000 s
STEP_NS = 1_000_000  # the harness clock (warm-up limiter) advances per step
PROMPT_MIN = 8
PROMPT_SPREAD = 16  # prompt lengths 8..23, so block boundaries are spread out
WARMUP_DECODE_STEPS = 3
SETTLE_STEPS = 2  # after switching to the state's limiter
COUNTED_STEPS = 8  # untimed steps that count limiter calls, after the rounds
SAMPLED_TOKEN = 42
FIVE_PERCENT = 1.05


@dataclass
class _Subject:
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


def _model_output(scheduler: Any, output: Any) -> Any:
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


def _step(harness: Any) -> tuple[Any, int, int]:
    """One step: (output, ns in schedule(), ns in update_from_output())."""
    scheduler = harness.scheduler
    harness.clock.advance(STEP_NS)
    t0 = time.perf_counter_ns()
    output = scheduler.schedule()
    t1 = time.perf_counter_ns()
    model_output = _model_output(scheduler, output)
    t2 = time.perf_counter_ns()
    scheduler.update_from_output(output, model_output)
    t3 = time.perf_counter_ns()
    return output, t1 - t0, t3 - t2


def _check_state(subject: _Subject, output: Any, num_requests: int) -> None:
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


def _make_subjects(
    model_path: str,
    num_requests: int,
    user_counts: Sequence[int],
    rounds: int,
    scheduler_cls: type | None = None,
) -> list[_Subject]:
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
        _Subject(
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
                _Subject(
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


def _warm_up(subject: _Subject, num_requests: int) -> None:
    """Prefill everything, decode a little, then enter the subject's state."""
    harness = subject.harness
    scheduler = harness.scheduler
    output, _, _ = _step(harness)
    _check(
        len(scheduler.running) == num_requests and not scheduler.waiting,
        "prefill did not admit every request in one step",
    )
    for _ in range(WARMUP_DECODE_STEPS):
        output, _, _ = _step(harness)
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
            _step(harness)


def _count_limiter_calls(subject: _Subject, num_requests: int) -> None:
    if subject.limiter is None:
        return
    counting = CountingLimiter.count_calls(subject.limiter)
    for _ in range(COUNTED_STEPS):
        output, _, _ = _step(subject.harness)
        _check_state(subject, output, num_requests)
    subject.calls = counting.calls


def _measure_size(
    model_path: str,
    num_requests: int,
    user_counts: Sequence[int],
    rounds: int,
    rng: random.Random,
    scheduler_cls: type | None = None,
) -> list[_Subject]:
    subjects = _make_subjects(
        model_path, num_requests, user_counts, rounds, scheduler_cls
    )
    for subject in subjects:
        _warm_up(subject, num_requests)
    # Like vLLM's engine after start-up: long-lived objects leave the GC's view.
    gc.collect()
    gc.freeze()
    try:
        order = list(subjects)
        for _ in range(rounds):
            rng.shuffle(order)
            for subject in order:
                output, schedule_ns, update_ns = _step(subject.harness)
                subject.schedule_ns.append(schedule_ns)
                subject.update_ns.append(update_ns)
                _check_state(subject, output, num_requests)
    finally:
        gc.unfreeze()
    for subject in subjects:
        _count_limiter_calls(subject, num_requests)
    return subjects


def _us(samples: Sequence[int]) -> float:
    return statistics.median(samples) / 1000


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _rows_for_size(subjects: list[_Subject], num_requests: int) -> tuple[dict, list]:
    stock = subjects[0]
    stock_row = {
        "R": num_requests,
        "schedule_us": _us(stock.schedule_ns),
        "update_us": _us(stock.update_ns),
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
                "ours_us": _us(subject.schedule_ns),
                "stock_us": stock_row["schedule_us"],
                "ratio": statistics.median(ratios),
                "ratio_q1": q1,
                "ratio_q3": q3,
                "ours_update_us": _us(subject.update_ns),
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


# ----- output ---------------------------------------------------------------


def plot(results: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """µs per schedule() against R: one panel per state, one line per U."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    stock = sorted(results["stock"], key=lambda s: s["R"])
    for ax in axes[1:3]:
        ax.sharey(axes[0])
    for ax, (state, title) in zip(axes, STATES.items(), strict=False):
        ax.plot(
            [s["R"] for s in stock],
            [s["schedule_us"] for s in stock],
            "k--o",
            label="stock vLLM (all R decode)",
        )
        for users in results["meta"]["user_counts"]:
            points = sorted(
                (r["R"], r["ours_us"])
                for r in results["rows"]
                if r["state"] == state and r["U"] == users
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, "-o", label=f"ours, U={users}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"({state}) {title}")
        ax.set_xlabel("resident requests R")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ratio_ax = axes[3]
    for state in STATES:
        for users in results["meta"]["user_counts"]:
            points = sorted(
                (r["R"], r["ratio"])
                for r in results["rows"]
                if r["state"] == state and r["U"] == users
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ratio_ax.plot(xs, ys, "-o", label=f"({state}) U={users}")
    ratio_ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ratio_ax.axhline(FIVE_PERCENT, color="r", linestyle=":", linewidth=1)
    ratio_ax.set_xscale("log", base=2)
    ratio_ax.set_title("ours / stock (median of per-round ratios)")
    ratio_ax.set_xlabel("resident requests R")
    ratio_ax.grid(True, which="both", alpha=0.3)
    ratio_ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel("µs per schedule() (median)")
    fig.suptitle("Scheduler step cost: output-rate scheduler vs stock vLLM")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def format_markdown(
    results: dict[str, Any], plot_path: str | os.PathLike[str] | None = None
) -> str:
    """A Markdown section with one table per state (and the plot, if a path)."""
    meta = results["meta"]
    lines = [
        "## Scheduler step cost at scale",
        "",
        f"vLLM {meta['vllm']}, Python {meta['python']}, {meta['cpus']} CPU(s), "
        f"{'quick' if meta['quick'] else 'full'} run, "
        f"{meta['elapsed_s']:.0f} s, ours = `{meta['scheduler']}`. "
        "Real V1 scheduler and KV cache manager, no "
        "model; synchronous scheduling; R requests resident and decoding, spread "
        "round-robin over U users. Times are medians over rounds (timed steps per "
        "scheduler: "
        + ", ".join(f"R={r}: {n}" for r, n in meta["rounds"].items())
        + "); the ratio is the median over rounds of ours / stock in the same "
        "round (interquartile range in brackets). Stock vLLM decodes all R "
        "requests in every state.",
        "",
    ]
    for state, title in STATES.items():
        rows = sorted(
            (r for r in results["rows"] if r["state"] == state),
            key=lambda r: (r["R"], r["U"]),
        )
        if not rows:
            continue
        lines += [
            f"### ({state}) {title}",
            "",
            "| R | U | decoding | ours µs | stock µs | ratio | limiter calls/step "
            "| ours update µs | stock update µs |",
            "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['R']} | {r['U']} | {r['scheduled_per_step']:.0f} "
                f"| {r['ours_us']:,.0f} | {r['stock_us']:,.0f} "
                f"| {r['ratio']:.3f} [{r['ratio_q1']:.2f}–{r['ratio_q3']:.2f}] "
                f"| {r['limiter_calls_per_step']:.1f} "
                f"| {r['ours_update_us']:,.0f} | {r['stock_update_us']:,.0f} |"
            )
        lines.append("")
    targets = results["targets"]
    a = targets["a_within_5_percent_of_stock"]
    g = targets["limiter_calls_grow_with_U_not_R"]
    b = targets["b_not_above_stock"]
    calls = "; ".join(
        f"({state}) "
        + ", ".join(
            f"U={u}: {'/'.join(f'{c:g}' for c in per_r)}" for u, per_r in per_u.items()
        )
        for state, per_u in g["calls_per_step_by_state_and_U"].items()
    )
    lines += [
        "### Targets",
        "",
        f"- Nobody throttled, within 5 % of stock: {_verdict(a['met'])} "
        f"(worst ratio {a['worst_ratio']:.3f}).",
        f"- Limiter work grows with U, not R: {_verdict(g['met'])} "
        f"(limiter calls per step for increasing R: {calls}).",
        f"- Fully throttled step no dearer than a stock step: {_verdict(b['met'])} "
        f"(worst ratio {b['worst_ratio']:.3f}).",
        "",
    ]
    if plot_path is not None:
        written = plot(results, plot_path)
        lines += [f"![µs per schedule() against R]({written})", ""]
    return "\n".join(lines)


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
    print(format_markdown(results, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
