"""Teams over users (``teams``'s results): a step's cost with 100 teams x
100 users against the user-only plugin, and a team's rate at the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, fmt

TITLE = "Teams over users"
COST_TARGET = 1.05
ACC_RANGE = (1.00, 1.02)
ABOUT = (
    "**Step cost** (vLLM's real scheduler and KV cache manager, no model): "
    "{users:,} users ({teams} teams of {members}), each decoding one request, "
    "limits far above demand; `schedule()` and the step's settling, with every "
    "user in a team against the same users without teams, {rounds} rounds "
    "side by side in shuffled order, the median over rounds of with teams / "
    "users only in the same round. With one team throttled (its limit "
    "{throttled:g} tok/s), the baseline throttles the same {members} users "
    "without teams, each at an even part of it."
)


def _cost(results: dict[str, Any], name: str) -> float:
    return float(results["step_cost"]["subjects"][name]["ratio"])


def summary_rows(results: dict[str, Any]) -> list[Row]:
    acc = results["accuracy"]
    ratio = acc["team_ratio"]
    members_ok = all(
        rate <= acc["member_limit"] * 1.001 for rate in acc["member_rates"].values()
    )
    return [
        (
            f"teams: step cost, {name}, / user-only plugin",
            f"<= {COST_TARGET}x",
            f"{fmt(_cost(results, name), 3)}x",
            _cost(results, name) <= COST_TARGET,
        )
        for name in ("teams, nobody throttled", "teams, one throttled")
    ] + [
        (
            "teams: a team's rate at the engine / its limit (members within theirs)",
            f"{ACC_RANGE[0]:.2f}-{ACC_RANGE[1]:.2f}",
            f"{fmt(ratio, 3)} (members {'within' if members_ok else 'over'})",
            ACC_RANGE[0] <= ratio <= ACC_RANGE[1] and members_ok,
        )
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {
        "teams_step_cost": _cost(results, "teams, nobody throttled"),
        "teams_accuracy": results["accuracy"]["team_ratio"],
    }


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    cost, acc = results["step_cost"], results["accuracy"]
    lines = [
        ABOUT.format(
            users=cost["teams"] * cost["members"],
            teams=cost["teams"],
            members=cost["members"],
            rounds=cost["rounds"],
            throttled=cost["throttled_team_rate"],
        ),
        "",
        "| scheduler | step ms | / its baseline |",
        "|---|---:|---:|",
    ]
    for name, subject in cost["subjects"].items():
        against = subject.get("against")
        ratio = f"{fmt(subject['ratio'], 3)} (/ {against})" if against else ""
        lines.append(f"| {name} | {fmt(subject['schedule_ms'], 2)} | {ratio} |")
    lines += [
        "",
        f"**Accuracy at the engine** (a real server): a team of "
        f"{len(acc['member_rates'])} members with a {acc['team_limit']:g} tok/s "
        f"team limit, each member's own limit {acc['member_limit']:g} tok/s, "
        f"{acc['streams_per_member']} streams each for {acc['seconds']:g} s; "
        "rates from the scheduler's dispatch log, the first second left out:",
        "",
        "| who | tok/s at the engine | / limit |",
        "|---|---:|---:|",
        f"| the team | {fmt(acc['team_rate'], 1)} | {fmt(acc['team_ratio'], 3)} |",
    ]
    for user, rate in acc["member_rates"].items():
        lines.append(
            f"| {user} | {fmt(rate, 1)} | {fmt(rate / acc['member_limit'], 3)} |"
        )
    return "\n".join([*lines, ""])
