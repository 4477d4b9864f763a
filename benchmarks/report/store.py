"""Section 7 of the report: one user's limit across engines sharing a
store (``benchmarks.store``'s results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TITLE = "7. Several engines sharing a store"
ABOUT = (
    "Three measurements against a real redis-server started by the benchmark "
    "(`benchmarks/store.py`): two engines' leases on one fake clock (the "
    "tests' lease simulation), users split 3:1, 1:1 and on one engine only, "
    "demand far above the limits: delivered / limit per user and the most "
    "tokens in any 1 s window against the global bound; store round trips per "
    "engine for 10, 100 and 1,000 active users; vLLM's real scheduler (no "
    "model) with 10,000 distinct active users, `schedule()` with the local "
    "limiter against leases from the store (interleaved steps); and with "
    "`--engines`, the engine-throughput load on two real engines, with the "
    "store against without (paired rounds)."
)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) for the report's summary table."""
    ratios = [row["ratio"] for row in results["accuracy"].values()]
    trips = [row["round_trips_per_s"] for row in results["round_trips"].values()]
    rows: list[tuple[str, str, str, bool | None]] = [
        (
            "7. store: delivered / limit",
            "0.98-1.02 per user, 2 engines",
            f"{min(ratios):.3f}-{max(ratios):.3f}",
            all(0.98 <= r <= 1.02 for r in ratios),
        ),
        (
            "7. store: round trips",
            "grow with active users and lease rate, not tokens",
            f"{min(trips):.1f}-{max(trips):.1f} per s per engine for 10-1,000 users",
            max(trips) <= 1.2 * min(trips),
        ),
        (
            "7. store: step cost, 10,000 users",
            "reported (no target)",
            f"with the store / without {results['step_cost']['ratio']:.3f}",
            None,
        ),
    ]
    if "engine" in results:
        ratio = results["engine"]["ratio_median"]
        rows.append(
            (
                "7. store: engine throughput, limits not binding",
                "with the store / without >= 0.98",
                f"{ratio:.3f}",
                ratio >= 0.98,
            )
        )
    return rows


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    return f"## {TITLE}\n\n{ABOUT}\n\n{tables(results)}\n"


def tables(result: dict[str, Any]) -> str:
    """The measurements as Markdown tables and sentences."""
    lines = [
        "| user | limit | streams a/b | delivered a/b | delivered / limit | "
        "max in 1 s (bound) |",
        "|---|---|---|---|---|---|",
    ]
    for user, row in result["accuracy"].items():
        a, b = row["delivered_per_engine"]
        lines.append(
            f"| {user} | {row['limit']:g} | {row['streams'][0]}/{row['streams'][1]} "
            f"| {a}/{b} | {row['ratio']:.3f} | {row['max_in_1s_window']} "
            f"({row['bound_1s']:g}) |"
        )
    lines += [
        "",
        "| active users | round trips / s / engine | users asked / s / engine "
        "| tokens / s / engine | mean round trip ms |",
        "|---|---|---|---|---|",
    ]
    for users, row in result["round_trips"].items():
        lines.append(
            f"| {users} | {row['round_trips_per_s']:.1f} "
            f"| {row['users_asked_per_s']:.0f} | {row['tokens_per_s']:.0f} "
            f"| {row['rtt_mean_ms']:.2f} |"
        )
    if "engine" in result:
        eng = result["engine"]
        q1, q3 = eng["ratio_quartiles"]
        lines += [
            "",
            f"Engine throughput, limits not binding, with the store / without: "
            f"{eng['ratio_median']:.3f} (quartiles {q1:.3f}-{q3:.3f}, "
            f"{eng['rounds']} paired rounds).",
        ]
    cost = result["step_cost"]
    lines += [
        "",
        f"schedule() with {cost['users']:,} active users: local "
        f"{cost['local_ms']:.2f} ms, with the store {cost['store_ms']:.2f} ms "
        f"(ratio {cost['ratio']:.3f}).",
    ]
    return "\n".join(lines)
