"""Several engines sharing one user's limit through a store (``store``'s
results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, judged
from benchmarks.report.throughput import engine_lines

TITLE = "Engines sharing a store"
ENGINE_TARGET = 0.98
ABOUT = (
    "Against a real redis-server started by the benchmark: store round trips "
    "per engine for 10, 100 and 1,000 active users (two engines' leases on "
    "one fake clock, the tests' lease simulation), and two real engines, ours "
    "with the store against ours without. That the limit holds across engines "
    "is tested (`tests/store/test_leases.py`)."
)


def summary_rows(results: dict[str, Any]) -> list[Row]:
    trips = [row["round_trips_per_s"] for row in results["round_trips"].values()]
    rows: list[Row] = [
        (
            "store: round trips",
            "grow with active users and lease rate, not tokens",
            f"{min(trips):.1f}-{max(trips):.1f} per s per engine for 10-1,000 users",
            max(trips) <= 1.2 * min(trips),
        ),
    ]
    if "engine" in results:
        ratio = results["engine"]["ratio_median"]
        rows.append(
            (
                "store: engine throughput, limits not binding",
                f"with the store / without >= {ENGINE_TARGET:g}",
                judged(ratio, ENGINE_TARGET),
                ratio >= ENGINE_TARGET,
            )
        )
    return rows


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    engine = results.get("engine")
    return {"store_engine": engine["ratio_median"] if engine else None}


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [
        ABOUT,
        "",
        "| active users | round trips / s / engine | users asked / s / engine "
        "| tokens / s / engine | mean round trip ms |",
        "|---|---|---|---|---|",
    ]
    for users, row in results["round_trips"].items():
        lines.append(
            f"| {users} | {row['round_trips_per_s']:.1f} "
            f"| {row['users_asked_per_s']:.0f} | {row['tokens_per_s']:.0f} "
            f"| {row['rtt_mean_ms']:.2f} |"
        )
    lines.append("")
    if "engine" in results:
        lines += engine_lines(results["engine"], ENGINE_TARGET)
    return "\n".join(lines)
