"""Run the benchmarks and write BENCHMARKS.md (``make bench``).

Usage::

    python -m benchmarks [--quick] [--only NAME ...] [--render-only]
        [--results DIR] [--output BENCHMARKS.md] [--figures DIR] [--work-dir DIR]

Measures the selected sections (all by default; ``suite.ORDER``), keeps
their results in ``benchmarks/results/latest.json`` (the other sections keep
theirs), adds a row to ``history.json`` unless ``--quick``, then renders the
whole report from the kept results; ``--render-only`` measures nothing.
Figures go to ``docs/bench/`` next to the report; server logs and engine
logs to the work folder. ``make bench`` runs it from the checkout's top with
``tests/`` and the checkout on PYTHONPATH. Try the whole thing without
touching the repository's files with ``--quick --results /tmp/r --output
/tmp/r/BENCHMARKS.md``. Exit code 0 when every selected section ran, 1 when
one failed, 2 outside a checkout of the project, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import checkout, results
from benchmarks.measure import log


def _parser(root: Path) -> argparse.ArgumentParser:
    from benchmarks.suite import ORDER

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmarks (ours vs stock vLLM) and write BENCHMARKS.md.",
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ORDER,
        metavar="NAME",
        help=f"measure only these sections ({', '.join(ORDER)})",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="measure nothing, render the report"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=results.RESULTS_DIR,
        help="folder of the kept results (latest.json, history.json)",
    )
    parser.add_argument("--output", type=Path, default=root / "BENCHMARKS.md")
    parser.add_argument(
        "--figures", type=Path, help="PNG figures (default: docs/bench by the report)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="logs of servers and engines (default: results/bench/<date-time>)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        root = checkout.repo_root()
    except checkout.NotACheckout as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    checkout.importable(root)
    args = _parser(root).parse_args(argv)
    from benchmarks.report import document

    entries = results.load_latest(args.results)
    rows = results.load_history(args.results)
    failed = False
    if not args.render_only:
        from benchmarks import suite

        selected = [n for n in suite.ORDER if not args.only or n in args.only]
        command = "python -m benchmarks" + "".join(" " + shlex.quote(a) for a in argv)
        run = suite.run_info(command, args.quick)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        work_dir = (args.work_dir or root / "results" / "bench" / stamp).resolve()
        log(f"{command}: {', '.join(selected)}; logs in {work_dir}")
        try:
            outcomes = suite.run(selected, args.quick, work_dir)
        except KeyboardInterrupt:
            return 130
        results.save_latest(args.results, results.update_latest(entries, run, outcomes))
        # Rendered from the kept results (saved with sorted keys), so that a
        # later --render-only writes the same document.
        entries = results.load_latest(args.results)
        measured = {n: o["results"] for n, o in outcomes.items() if "results" in o}
        if measured and not args.quick:
            rows = [*rows, document.headline_row(run, measured)]
            results.save_history(args.results, rows)
        failed = any("error" in o for o in outcomes.values())
    output = args.output.resolve()
    figures = (args.figures or output.parent / "docs" / "bench").resolve()
    document.write(entries, rows, output, figures)
    print(f"wrote {output} (figures in {figures})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
