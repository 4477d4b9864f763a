"""Speculative decoding with limits, ours against stock (``speculative``'s
results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, judged
from benchmarks.report.throughput import engine_lines

TITLE = "Speculative decoding"
STEP_TARGET = 1.05
# As for the scheduler step cost: with fewer requests stock's whole step is
# so short (0.19 ms at R = 16) that the plugin's fixed ~11 µs a step reads as
# a ratio over 1.05 while costing an engine step well under 1 %.
STEP_JUDGED_FROM = 64
RATIO_TARGET = 0.98
DELIVERED_RANGE = (1.00, 1.02)
ABOUT = (
    'n-gram speculation, 4 draft tokens, on the tiny "echo" model (it '
    "predicts its input token, so drafts are accepted). Step cost: one "
    "scheduler step with speculation on and no limit binding, ours / stock "
    "on vLLM's real scheduler (synthetic drafts and acceptance), median over "
    "rounds, judged from R = 64 on `schedule()`, what vLLM's engine waits "
    "for (the plugin settles a step in `get_grammar_bitmask()`, which the "
    "engine calls once the step has gone to the model worker: given beside "
    "as context). Draft acceptance of a user far below its limit, from "
    "vLLM's own counters, on a stock and an ours server up at once, in "
    "alternating rounds of 16 requests x 200 tokens; only the greedy ratio "
    "is judged: at temperature 1 the random-weight model's acceptance "
    "differs between server instances of one configuration far more than "
    "between rounds (0.2 % to 24 % over ten instances). Delivered / limit: "
    "users at 20 and 100 tok/s with 4 streams each at temperature 1 (drafts "
    "rejected), from ours' dispatch log, and the bound `(W + 0.1) x limit + "
    "1` on every window, exactly (the most tokens any window held beyond "
    "it; negative is room left)."
)


def _size(key: str) -> int:
    """R of a step-cost key such as ``R=16,U=4``."""
    return int(key.split(",")[0].removeprefix("R="))


def _judged_step(results: dict[str, Any]) -> list[float]:
    return [
        cost["critical_ratio"]
        for key, cost in results["step_cost"].items()
        if _size(key) >= STEP_JUDGED_FROM
    ]


def summary_rows(results: dict[str, Any]) -> list[Row]:
    steps = _judged_step(results)
    rows: list[Row] = [
        (
            "speculative: scheduler step, no limit binds",
            f"ours / stock <= {STEP_TARGET:g} from R = {STEP_JUDGED_FROM}",
            f"schedule() {min(steps):.3f}-{max(steps):.3f}",
            max(steps) <= STEP_TARGET,
        )
    ]
    if "engine" in results:
        engine = results["engine"]
        q1, q3 = engine["ratio_quartiles"]
        rows.append(
            (
                "speculative: engine throughput, limits far above demand",
                f"ours / stock >= {RATIO_TARGET:g}",
                f"{judged(engine['ratio_median'], RATIO_TARGET)} [{q1:.2f}-{q3:.2f}]",
                engine["ratio_median"] >= RATIO_TARGET,
            )
        )
    if "servers" in results:
        greedy = results["servers"]["acceptance"]["greedy"]
        ratio = greedy["ours"]["rate"] / greedy["stock"]["rate"]
        accuracy = results["servers"]["accuracy"].values()
        delivered = [f["delivered_per_limit"] for f in accuracy]
        lo, hi = DELIVERED_RANGE
        rows += [
            (
                "speculative: greedy draft acceptance below the limit",
                f"ours / stock >= {RATIO_TARGET:g}",
                judged(ratio, RATIO_TARGET),
                ratio >= RATIO_TARGET,
            ),
            (
                "speculative: delivered / limit (engine)",
                f"{lo:.2f}-{hi:.2f}, bound held",
                ", ".join(f"{d:.3f}" for d in delivered),
                all(lo <= round(d, 2) <= hi for d in delivered)
                and all(f["bound_held"] for f in accuracy),
            ),
        ]
    return rows


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    engine = results.get("engine")
    return {
        "speculative_engine": engine["ratio_median"] if engine else None,
        "speculative_step": max(_judged_step(results), default=None),
    }


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [
        ABOUT,
        "",
        "| R, U | schedule() ours / stock | µs ours / stock | with the settling "
        "and update_from_output() | target |",
        "|---|---:|---:|---:|---|",
    ]
    for key, cost in results["step_cost"].items():
        judged = _size(key) >= STEP_JUDGED_FROM
        lines.append(
            f"| {key} | {cost['critical_ratio']:.3f} "
            f"| {cost['ours_critical_us']:.0f} / {cost['stock_critical_us']:.0f} "
            f"| {cost['step_ratio']:.3f} "
            f"| {f'<= {STEP_TARGET:g}' if judged else 'reported'} |"
        )
    lines.append("")
    if "servers" in results:
        srv = results["servers"]
        lines += [
            "| draft acceptance | ours | stock | ours / stock | rounds (ours; "
            "stock) | ours' throttled request-steps |",
            "|---|---:|---:|---:|---|---:|",
        ]
        for mode, per in srv["acceptance"].items():
            o, s = per["ours"], per["stock"]
            throttled = sum(r["throttled_request_steps"] for r in o["rounds"])
            lines.append(
                f"| {mode} | {o['rate']:.3f} | {s['rate']:.3f} "
                f"| {o['rate'] / s['rate']:.3f} | {o['min']:.3f}-{o['max']:.3f}; "
                f"{s['min']:.3f}-{s['max']:.3f} | {throttled:.0f} |"
            )
        lines += [
            "",
            "| user | limit | delivered / limit | bound | most tokens beyond it |",
            "|---|---:|---:|---|---:|",
        ]
        for user, f in srv["accuracy"].items():
            lines.append(
                f"| {user} | {f['limit']} | {f['delivered_per_limit']:.3f} "
                f"| {'held' if f['bound_held'] else '**broken**'} "
                f"| {f['bound_excess_tokens']:+.3f} |"
            )
        lines.append("")
    if "engine" in results:
        lines += engine_lines(results["engine"], RATIO_TARGET)
    return "\n".join(lines)
