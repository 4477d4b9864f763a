"""Run the project's benchmarks and write BENCHMARKS.md (``make bench``).

Usage::

    python -m benchmarks [--quick] [--only NAME ...]
        [--output BENCHMARKS.md] [--figures DIR] [--work-dir DIR]
    python -m benchmarks --from-results results/bench/STAMP/results.json [...]

``make bench`` runs the first form from the checkout's top with ``tests/``
and the checkout on PYTHONPATH (``make bench BENCH_ARGS="--quick"`` passes
options). Benchmarks, in the order they run: ``scheduler_cost`` (one
scheduler step without a model, before any server starts), ``store``
(several engines sharing one Redis store, with its own redis-server and
engines), ``speculative`` (its own servers with speculation on),
``fair_shares`` (its own saturated servers, then the ranking's step cost), then
``throughput``, ``isolation``, ``idle``, ``accuracy`` and
``metrics_scrape`` on real vLLM OpenAI servers, stock against ours
(``benchmarks.suite``).

Every figure is a ratio of measurements taken side by side in the same run.
The raw results (``results.json``) and server logs go to the work folder;
the report (``benchmarks.report``) is made from ``results.json`` alone, and
``--from-results`` re-renders it from a past run without measuring. Figures
go to ``docs/bench/`` next to the report. Exit code 0 when every benchmark
ran (targets missed or not), 1 when one failed to run, 2 outside a checkout
of the project, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import checkout
from benchmarks.progress import log


def _parser(root: Path) -> argparse.ArgumentParser:
    from benchmarks.suite import ORDER

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmarks (ours vs stock vLLM) and write BENCHMARKS.md.",
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs (~6 min)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ORDER,
        metavar="NAME",
        help=f"run only these benchmarks ({', '.join(ORDER)})",
    )
    parser.add_argument(
        "--output", type=Path, default=root / "BENCHMARKS.md", help="the report"
    )
    parser.add_argument(
        "--figures",
        type=Path,
        default=None,
        help="folder for PNG figures (default: docs/bench next to the report)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="folder for raw JSON results and server logs "
        "(default: results/bench/<date-time>)",
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="measure nothing: write the report from past runs' results.json "
        "(oldest first; a later run's benchmark replaces an earlier one's)",
    )
    return parser


def _command(argv: Sequence[str]) -> str:
    return "python -m benchmarks" + "".join(" " + shlex.quote(a) for a in argv)


def _measure(args: argparse.Namespace, root: Path, command: str) -> dict[str, Any]:
    from benchmarks import suite

    selected = [n for n in suite.ORDER if not args.only or n in args.only]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work_dir = (args.work_dir or root / "results" / "bench" / stamp).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    log(f"{command}: {', '.join(selected)}; raw results in {work_dir}")
    raw = suite.run(selected, args.quick, work_dir, command)
    results_json = work_dir / "results.json"
    results_json.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    log(f"raw results: {results_json}")
    return raw


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        root = checkout.repo_root()
    except checkout.NotACheckout as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    checkout.importable(root)
    parser = _parser(root)
    args = parser.parse_args(argv)
    if args.from_results and (args.quick or args.only or args.work_dir):
        parser.error(
            "--from-results measures nothing: it takes no --quick, --only or --work-dir"
        )
    output = args.output.resolve()
    figures_dir = (args.figures or output.parent / "docs" / "bench").resolve()
    command = _command(argv)
    if args.from_results:
        from benchmarks.report.runs import merge

        raw = merge([json.loads(path.read_text()) for path in args.from_results])
        rerendered_by: str | None = command
    else:
        try:
            raw = _measure(args, root, command)
        except KeyboardInterrupt:
            return 130
        rerendered_by = None
    from benchmarks.report import document

    document.write(raw, output, figures_dir, rerendered_by)
    log(
        f"wrote {output} and figures in {figures_dir} "
        f"({raw['elapsed_s'] / 60:.1f} min of measuring)"
    )
    return 1 if raw["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
