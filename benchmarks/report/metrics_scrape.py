"""Section 6 of the report: a metrics scrape against the number of
configured users (``metrics_scrape``'s results), as a table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.report.markdown import verdict

TITLE = "6. Metrics scrape against configured users"


def _power(n: int) -> str:
    exponent = round(math.log10(n))
    return f"10^{exponent}" if 10**exponent == n else f"{n:,}"


def _sizes(results: dict[str, Any]) -> list[str]:
    return [_power(row["configured_users"]) for row in results["rows"]]


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) for the report's summary table."""
    sizes = _sizes(results)
    return [
        (
            f"6. metrics scrape, {sizes[0]} to {sizes[-1]} configured users",
            f"scrape at the largest size <= {results['target_ratio']:g}x the smallest",
            f"{results['ratio']:.2f}x ("
            + ", ".join(
                f"{row['configured_users']:,}: {1000 * row['scrape_s']:.0f} ms"
                for row in results["rows"]
            )
            + ")",
            results["met"],
        )
    ]


def table(results: dict[str, Any]) -> list[str]:
    """The table of sizes and the target line."""
    lines = [
        "| configured users | users with traffic | /metrics size | our lines | "
        f"`user` labels | scrape (median of {results['scrapes']}) | "
        f"vs {_sizes(results)[0]} | admin stats, all pages |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['configured_users']:,} | {row['users_with_traffic']:,} | "
            f"{row['scrape_bytes'] / 1024:,.0f} KiB | {row['our_lines']:,} | "
            f"{row['user_labels']} | {1000 * row['scrape_s']:.1f} ms | "
            f"{row['scrape_ratio']:.2f}x | {1000 * row['stats_pass_s']:.0f} ms |"
        )
    return [
        *lines,
        "",
        f"Target: a scrape at the largest size within {results['target_ratio']:g}x "
        f"of the smallest: {results['ratio']:.2f}x, {verdict(results['met'])}.",
    ]


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    sizes = _sizes(results)
    listed = ", ".join(sizes[:-1]) + f" and {sizes[-1]}" if len(sizes) > 1 else sizes[0]
    lines = [
        f"## {TITLE}",
        "",
        "One vLLM server with the plugin; its user table grows through the admin "
        f"endpoint to {listed} users with their own limit, and at each size "
        f"{results['distinct_users']} more distinct users send a request (more "
        "users want a `user` label than there are). `GET /metrics` is timed "
        f"{results['scrapes']} times (median), and one pass over every page of "
        "the admin stats endpoint. Before the label bound the issue measured "
        "13.5 MB and 2.1 s per scrape at 200,000 users.",
        "",
        *table(results),
        "",
    ]
    return "\n".join(lines)
