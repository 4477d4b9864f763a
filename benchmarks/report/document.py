"""BENCHMARKS.md, whole, from the kept results of every section.

Input: section name -> its latest entry (``results.load_latest``: the run
that measured it, and its results or error) and the history rows. Output:
a header (what is compared, on what, how to run it), the summary table (one
row per target), one part per section, each opening with the one line that
names its run, and the history table. A section never measured, or whose
run failed, says so; one that cannot be formatted says that and the rest is
kept. Each section module gives ``TITLE``, ``summary_rows``, ``headlines``
and ``section`` (Markdown, writing its figures into the figures folder).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.report import (
    accuracy,
    admission,
    cache_salt,
    fair_shares,
    history,
    isolation,
    kv_full,
    prefill,
    scheduler_cost,
    speculative,
    store,
    teams,
    throughput,
)
from benchmarks.report.format import verdict

SECTIONS: dict[str, ModuleType] = {
    "throughput": throughput,
    "scheduler_cost": scheduler_cost,
    "isolation": isolation,
    "accuracy": accuracy,
    "store": store,
    "speculative": speculative,
    "fair_shares": fair_shares,
    "kv_full": kv_full,
    "admission": admission,
    "cache_salt": cache_salt,
    "prefill": prefill,
    "teams": teams,
}


def headline_row(run: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """The history row of one run: ``measured`` is section -> its results."""
    row: dict[str, Any] = {
        "date": run["date"],
        "commit": run["commit"],
        "sections": list(measured),
    }
    for name, results in measured.items():
        try:
            row.update(SECTIONS[name].headlines(results))
        except Exception as exc:  # a broken formatter must not lose the run
            row["note"] = f"{name}: no headline ({exc!r})"
    return row


def _latest_run(entries: dict[str, Any]) -> dict[str, Any] | None:
    runs = [entry["run"] for entry in entries.values()]
    return max(runs, key=lambda run: run["date"]) if runs else None


def _header(entries: dict[str, Any]) -> list[str]:
    lines = [
        "# Benchmarks",
        "",
        "Generated whole by `make bench` from the results kept in "
        "`benchmarks/results/` (do not edit it by hand). Every figure compares "
        "this plugin with stock vLLM (or with itself without the store) "
        "measured side by side in the same run, on the same tiny random-weight "
        "model (`src/vllm_output_rate/demo/tiny_model.py`), with the same engine "
        "settings and the same load; the machines are shared and noisy, so "
        "ratios matter, absolute numbers are context only. Each section names "
        "the run that measured it: `make bench` measures every section, "
        '`make bench BENCH_ARGS="--only NAME ..."` measures those again and '
        "renders the rest from the kept results.",
        "",
    ]
    run = _latest_run(entries)
    if run is not None:
        flags = " ".join(
            k if v is True else f"{k} {shlex.quote(str(v))}"
            for k, v in run["servers"]["flags"].items()
        )
        env = " ".join(f"{k}={v}" for k, v in run["servers"]["env"].items())
        versions = run["versions"]
        lines += [
            f"- Latest run: {run['date']}, commit {run['commit']}, on {run['machine']}",
            f"- vLLM {versions['vllm']}; vllm-output-rate "
            f"{versions['vllm_output_rate']}; torch {versions['torch']}",
            f"- Servers: `{flags}`" + (f", `{env}`" if env else ""),
            "",
        ]
    quick = [name for name, e in entries.items() if e["run"]["quick"]]
    if quick:
        lines += [
            f"**From a quick run (shorter, noisier): {', '.join(quick)}.**",
            "",
        ]
    return lines


def _summary(entries: dict[str, Any]) -> list[str]:
    lines = ["## Summary", "", "| benchmark | target | measured | verdict |"]
    lines.append("|---|---|---|---|")
    for name, module in SECTIONS.items():
        entry = entries.get(name)
        if entry is None or "results" not in entry:
            why = f"did not run: {entry['error']}" if entry else "not measured yet"
            lines.append(f"| {module.TITLE} | - | {why} | n.a. |")
            continue
        try:
            rows = module.summary_rows(entry["results"])
        except Exception as exc:  # a broken formatter must not lose the rest
            rows = [(module.TITLE, "-", f"could not summarise: {exc!r}", None)]
        for what, target, measured, met in rows:
            lines.append(f"| {what} | {target} | {measured} | {verdict(met)} |")
    return [*lines, ""]


def _provenance(entry: dict[str, Any]) -> str:
    run = entry["run"]
    noise = entry.get("noise_cores")
    return (
        f"*Measured {run['date']} at commit {run['commit']} on {run['machine']}, "
        f"{'quick' if run['quick'] else 'full'} run (`{run['command']}`), "
        f"{entry['elapsed_s'] / 60:.0f} min"
        + (f"; other processes used {noise:.2f} cores meanwhile" if noise else "")
        + ".*"
    )


def _section(name: str, entry: dict[str, Any] | None, figures: Path, md: Path) -> str:
    module = SECTIONS[name]
    if entry is None:
        return f"## {module.TITLE}\n\nNot measured yet."
    head = f"## {module.TITLE}\n\n{_provenance(entry)}\n\n"
    if "results" not in entry:
        return head + f"Did not run: {entry['error']}"
    try:
        body: str = module.section(entry["results"], figures, md)
    except Exception as exc:  # a broken formatter must not lose the rest
        body = f"(Could not format the results: {exc!r})"
    return head + body.rstrip()


def render(
    entries: dict[str, Any],
    rows: list[dict[str, Any]],
    output: Path,
    figures_dir: Path,
) -> str:
    """The Markdown for ``output``; figures go to ``figures_dir``, linked
    relative to ``output``'s folder."""
    lines = _header(entries) + _summary(entries)
    for name in SECTIONS:
        lines += [_section(name, entries.get(name), figures_dir, output.parent), ""]
    lines += ["## History", "", *history.table(rows), ""]
    return "\n".join(lines)


def write(
    entries: dict[str, Any], rows: list[dict[str, Any]], output: Path, figures_dir: Path
) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)
    output.write_text(render(entries, rows, output, figures_dir))
