"""Benchmark-only: where a step's time goes, stock against ours (cProfile).

Not part of ``make bench``: a diagnosis, not a figure to judge (cProfile
roughly doubles the time of Python code, and this machine's speed swings;
call counts are exact). Each kind runs in its own process with vLLM's
engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), generates
``--rounds`` batches of ``benchmarks.engine_throughput``'s load under
cProfile after a warm-up, and the comparison prints the functions whose own
time differs most, with their call counts, and the main parts of the step.

Usage::

    PYTHONPATH=tests:. python -m benchmarks.engine_profile [--saturated]
        [--rounds N] [--top N]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.engine_throughput import KINDS, SATURATED, build_engine

# (file fragment, function) of the step's main parts, for the summary.
PARTS = [
    ("engine/core.py", "step"),
    ("sched/scheduler.py", "schedule"),
    ("scheduling/scheduler.py", "schedule"),
    ("gpu_model_runner.py", "execute_model"),
    ("gpu_model_runner.py", "_update_states"),
    ("sched/scheduler.py", "update_from_output"),
]
WARMUP = 3

Stats = dict[tuple[str, int, str], tuple[int, float, float]]


def profile_one(kind: str, rounds: int, path: Path) -> None:
    """In this process: build ``kind``'s engine, profile ``rounds`` batches."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    llm, params, prompts, _ = build_engine(kind, str(build_tiny_model()))
    for _ in range(WARMUP):
        llm.generate(prompts, params, use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    profiler.dump_stats(path)


def load_stats(path: Path) -> Stats:
    """(file, line, function) -> (calls, own time, cumulative time)."""
    raw = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    return {
        (file.split("site-packages/")[-1], line, name): (calls, own, cumulative)
        for (file, line, name), (_, calls, own, cumulative, _) in raw.items()
    }


def compare(stock: Stats, ours: Stats, top: int) -> str:
    lines = ["main parts (cumulative s, calls): stock -> ours"]
    for fragment, name in PARTS:
        for label, stats in (("stock", stock), ("ours", ours)):
            for (file, _, function), (calls, _, cumulative) in stats.items():
                if function == name and fragment in file:
                    lines.append(
                        f"  {label:5} {fragment}:{name} {cumulative:.3f} ({calls})"
                    )
    lines.append(f"\nown time, ours - stock (the {top} largest differences):")
    keys = set(stock) | set(ours)
    empty = (0, 0.0, 0.0)
    rows = sorted(keys, key=lambda k: ours.get(k, empty)[1] - stock.get(k, empty)[1])[
        ::-1
    ]
    for key in rows[:top]:
        s, o = stock.get(key, empty), ours.get(key, empty)
        lines.append(
            f"  {o[1] - s[1]:+.3f} s  {key[0]}:{key[1]} {key[2]}  "
            f"calls {s[0]} -> {o[0]}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_profile")
    parser.add_argument("--saturated", action="store_true", help="section 9's load")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        profile_one(args.child[0], args.rounds, Path(args.child[1]))
        return 0
    work = Path(tempfile.mkdtemp(prefix="engine-profile-"))
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    paths = {}
    for kind in KINDS:
        kind += SATURATED if args.saturated else ""
        paths[kind] = work / f"{kind}.pstats"
        command = [sys.executable, "-m", "benchmarks.engine_profile"]
        command += ["--rounds", str(args.rounds), "--child", kind, str(paths[kind])]
        subprocess.run(command, env=env, check=True)
    stock, ours = (load_stats(path) for path in paths.values())
    print(compare(stock, ours, args.top))
    print(f"\nprofiles: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
