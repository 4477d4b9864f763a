"""Per-user prefix-cache isolation (``cache_salt``'s results): the share of
prompt tokens the prefix cache served and the later users' latency, on ours
without and with ``--output-rate-cache-salt user``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, fmt

TITLE = "Per-user prefix-cache isolation"
ABOUT = (
    "One prompt of about 2,000 tokens sent by {users} users in turn, one token "
    "each, {rounds} rounds with a fresh prompt each; ours without and with "
    "`--output-rate-cache-salt user`, one server after the other. Without the "
    "salt every user after the first finds the prompt cached; with it each "
    "computes it again: the price of a miss on a shared prefix, and the "
    "isolation it buys (no user can find, or time, another's cached prompt)."
)


def _isolated(results: dict[str, Any]) -> bool:
    salted, unsalted = results["salted"]["hit_share"], results["unsalted"]["hit_share"]
    # Only the salt can explain no hit: the unsalted server must have hit.
    return salted == 0 and bool(unsalted)


def summary_rows(results: dict[str, Any]) -> list[Row]:
    ratio = results["latency_salted_over_unsalted"]
    return [
        (
            "cache salt: no user's prompt served from another's cache",
            "salted hit share 0 (unsalted > 0)",
            f"{fmt(results['salted']['hit_share'], 3)} "
            f"({fmt(results['unsalted']['hit_share'], 3)})",
            _isolated(results),
        ),
        (
            "cache salt: a later user's latency, salted / unsalted",
            "reported (the price of a cache miss)",
            fmt(ratio, 2),
            None,
        ),
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {"cache_salt_latency": results["latency_salted_over_unsalted"]}


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [
        ABOUT.format(users=results["users"], rounds=results["rounds"]),
        "",
        "| server | prompt tokens served from cache | later users' median latency s |",
        "|---|---:|---:|",
    ]
    for name in ("unsalted", "salted"):
        run = results[name]
        lines.append(
            f"| {name} | {fmt(run['hit_share'], 3)} "
            f"| {fmt(run['later_user_latency_s'], 3)} |"
        )
    lines += [
        "",
        "Later users' latency, salted / unsalted: "
        f"{fmt(results['latency_salted_over_unsalted'], 2)}.",
    ]
    return "\n".join([*lines, ""])
