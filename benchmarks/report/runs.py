"""One report from several runs' raw results (``--from-results A B ...``).

A later run's benchmark replaces an earlier run's of the same name, so a
report can keep a long full run's figures and take the benchmarks measured
again since from a shorter run (``--only``). The report then names, per
run, its command, commit, date and which benchmarks it gave (``sources``):
figures are compared side by side only within one run, never across runs.
"""

from __future__ import annotations

from typing import Any


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs (oldest first) as one raw-results dict for the report."""
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[-1])
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    noise: dict[str, Any] = {}
    given_by: dict[str, int] = {}
    for index, run in enumerate(runs):
        for name in run["benchmarks"]:
            if name in run["results"] or name in run["errors"]:
                results.pop(name, None)
                errors.pop(name, None)
                given_by[name] = index
        results.update(run["results"])
        errors.update(run["errors"])
        noise.update({k: v for k, v in run["noise"].items() if v is not None})
    order = [name for run in runs for name in run["benchmarks"]]
    merged.update(
        benchmarks=list(dict.fromkeys(order)),
        results=results,
        errors=errors,
        noise=noise,
        elapsed_s=sum(run["elapsed_s"] for run in runs),
        sources=[
            {
                "command": run["command"],
                "quick": run["quick"],
                "started_utc": run["started_utc"],
                "commit": run["versions"]["vllm_output_rate"].rsplit(", ", 1)[-1],
                "benchmarks": [n for n, i in given_by.items() if i == index],
            }
            for index, run in enumerate(runs)
        ],
    )
    return merged
