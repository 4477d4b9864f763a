"""Benchmark: a scheduler step with fair shares ranking contested slots.

``R`` resident requests spread round-robin over ``U`` users, half of the
users at weight 2, limits far above demand, and ``--max-num-active-seqs``
at ``R / 2``: every step hands the active slots out by rank
(``ordering.share_slots``), or keeps the last ranking's batch where ranking
could not change it (``kept_batch.py``), and defers the other half. Stock vLLM runs the
same requests with the same configuration (it admits ``R / 2`` and queues
the rest). Schedulers are stepped side by side in shuffled rounds (the
machines are noisy); a ratio is the median over rounds of ours / stock in
the same round. The claim checked: the cost grows with the users, not the
resident requests, so ``U = 10,000`` costs about what ``U = 256`` does at
the same ``R``. The plugin's Python work per step is counted apart, in a
few untimed steps (counting slows them): the Python and builtin calls its
code makes, which grow with the users served in a step, not with ``R``.

Usage::

    PYTHONPATH=tests:. python -m benchmarks.fair_share_cost [--requests 4096]
        [--rounds 30]

``make bench`` runs it as part of ``benchmarks.fair_shares`` (section 9);
alone, it prints its table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import vllm_output_rate
from harness.scheduler_sim import make_scheduler
from vllm_output_rate.demo.tiny_model import build_tiny_model

HUGE_RATE = 1e9
STEP_NS = 1_000_000
USER_COUNTS = (256, 10_000)
COUNTED_STEPS = 3
PLUGIN_DIR = str(Path(vllm_output_rate.__file__).parent)


def _subject(
    model_path: str, requests: int, users: int | None, seed: int
) -> tuple[str, Any]:
    limits = None
    if users is not None:
        weights = {f"user-{i}": 2.0 for i in range(0, users, 2)}
        limits = {
            "default_user_output_tokens_per_second": HUGE_RATE,
            "user_output_weight": weights,
        }
    h = make_scheduler(
        model_path,
        limits=limits,
        num_blocks=requests * 8,
        max_num_seqs=requests,
        max_num_active_seqs=requests // 2,
        max_num_batched_tokens=requests * 16,
    )
    rng = random.Random(seed)
    for k in range(requests):
        user = f"user-{k % (users or 1)}"
        h.add(user, prompt_len=8 + rng.randrange(16), max_tokens=1_000_000)
    return ("stock" if users is None else f"U={users:,}"), h


def run(requests: int, rounds: int) -> dict[str, dict[str, float]]:
    model_path = str(build_tiny_model())
    subjects = [_subject(model_path, requests, None, 1)]
    subjects += [_subject(model_path, requests, u, 1) for u in USER_COUNTS]
    for _, h in subjects:  # prefill everyone, then reach the steady state
        for _ in range(8):
            h.step(STEP_NS)
    times: dict[str, list[int]] = {name: [] for name, _ in subjects}
    ratios: dict[str, list[float]] = {name: [] for name, _ in subjects}
    rng = random.Random(7)
    for _ in range(rounds):
        order = list(subjects)
        rng.shuffle(order)
        this_round = {}
        for name, h in order:
            started = time.perf_counter_ns()
            h.step(STEP_NS)
            this_round[name] = time.perf_counter_ns() - started
            times[name].append(h.schedule_ns)
        for name in this_round:
            ratios[name].append(this_round[name] / this_round["stock"])
    return {
        name: {
            "schedule_ms": statistics.median(times[name]) / 1e6,
            "step_ratio_to_stock": statistics.median(ratios[name]),
            "plugin_calls_per_step": plugin_calls_per_step(h),
        }
        for name, h in subjects
    }


def plugin_calls_per_step(h: Any) -> float:
    """Calls into the plugin's Python code, and builtin calls it makes, per
    step (a generator counts once per item it yields)."""
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(
            PLUGIN_DIR
        ):
            calls += 1

    sys.setprofile(count)
    try:
        for _ in range(COUNTED_STEPS):
            h.step(STEP_NS)
    finally:
        sys.setprofile(None)
    return calls / COUNTED_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    results = run(args.requests, args.rounds)
    print(f"R = {args.requests:,} resident, active slots R/2, {args.rounds} rounds")
    print("| scheduler | schedule() median ms | step / stock (median) | plugin calls")
    print("| --- | --- | --- | --- |")
    for name, row in results.items():
        print(
            f"| {name} | {row['schedule_ms']:.2f} | {row['step_ratio_to_stock']:.2f} "
            f"| {row['plugin_calls_per_step']:,.0f} |"
        )


if __name__ == "__main__":
    main()
