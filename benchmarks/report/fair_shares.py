"""Fair shares on a saturated engine, ours against stock (``fair_shares``'s
results), with a figure of the judged users' shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import (
    Row,
    fmt,
    grouped_bars,
    image,
    judged,
    pyplot,
    save,
    verdict,
)
from benchmarks.report.throughput import engine_lines

TITLE = "Fair shares on a saturated engine"
FIGURE = "fair_shares.png"
# The judged (second) user's share of each scenario on ours; None: a floor.
EXPECTED_SHARE = {"weights": 2 / 3, "equal": 1 / 2, "floor": None}
FLOOR_TOK_S = 60.0  # the floored user's floor (kinds.FLOORS)
SHARE_TOLERANCE = 0.10  # of the expected ratio between the two users
FLOOR_TARGET = 0.9  # of the floor
ENGINE_TARGET = 0.98
# The contested step (``ranking_cost``), ours / stock, at every U measured.
CONTESTED_TARGET = 1.3
ABOUT = (
    "Limits far above demand on an engine with 3 active slots, so the engine "
    "itself is the bottleneck: a stock and an ours server (weights light 2, "
    "hog 20; a floor of 60 tok/s for floored) up at once, each scenario on "
    "each in turn, in rounds. Scenarios (user x streams): weights: many x 16, "
    "light x 2; equal: even-a x 16, even-b x 16; floor: hog x 32, floored "
    "x 2. Each stream is one request longer than the load, so every user "
    "stays backlogged. Ours is judged at the engine (its dispatch log), over "
    "the part of the window in which every user was served: vLLM's API "
    "server here can deliver tokens seconds late. Stock, which has no "
    "dispatch log, is read at the client; it serves in queue order, ours by "
    "weighted service (docs/architecture.md)."
)


def share_met(scenario: str, row: dict[str, Any]) -> bool:
    ours = row["ours"]
    if ours["failed"]:
        return False
    expected = EXPECTED_SHARE[scenario]
    if expected is None:
        return (ours["tok_s"] or 0.0) >= FLOOR_TARGET * FLOOR_TOK_S
    share = ours["share"]
    if share is None or share >= 1:
        return False
    want = expected / (1 - expected)
    return abs(share / (1 - share) / want - 1) <= SHARE_TOLERANCE


def _target(scenario: str, user: str) -> str:
    expected = EXPECTED_SHARE[scenario]
    if expected is None:
        return f"{user} >= {FLOOR_TARGET:g} x its floor ({FLOOR_TOK_S:g} tok/s)"
    want = expected / (1 - expected)
    return f"{user} : the other = {want:g} : 1 within {SHARE_TOLERANCE:.0%}"


def _measured(scenario: str, row: dict[str, Any]) -> str:
    if EXPECTED_SHARE[scenario] is None:
        return (
            f"{fmt(row['ours']['tok_s'], 0)} tok/s (stock "
            f"{fmt(row['stock']['tok_s'], 0)})"
        )
    return (
        f"share {fmt(row['ours']['share'], 3)} (stock {fmt(row['stock']['share'], 3)})"
    )


def summary_rows(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = [
        (
            f"fair shares, {scenario}",
            _target(scenario, row["user"]),
            _measured(scenario, row),
            share_met(scenario, row),
        )
        for scenario, row in results["servers"]["summary"].items()
    ]
    engine = results["engine"]
    q1, q3 = engine["ratio_quartiles"]
    rows.append(
        (
            "fair shares: engine throughput, saturated",
            f"ours / stock >= {ENGINE_TARGET:g}",
            f"{judged(engine['ratio_median'], ENGINE_TARGET)} [{q1:.2f}-{q3:.2f}]",
            engine["ratio_median"] >= ENGINE_TARGET,
        )
    )
    ratios = contested_ratios(results)
    requests = results["ranking_cost"]["requests"]
    rows.append(
        (
            f"fair shares: step with every slot contested, R = {requests:,}",
            f"ours / stock <= {CONTESTED_TARGET:g} at each U",
            ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items()),
            bool(ratios) and max(ratios.values()) <= CONTESTED_TARGET,
        )
    )
    return rows


def contested_ratios(results: dict[str, Any]) -> dict[str, float]:
    """The contested step's ours / stock per number of users."""
    subjects = results["ranking_cost"]["subjects"]
    return {name: row["ratio"] for name, row in subjects.items() if name != "stock"}


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {
        "saturated_engine": results["engine"]["ratio_median"],
        "contested_step": max(contested_ratios(results).values(), default=None),
    }


def _plot(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    summary = results["servers"]["summary"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    grouped_bars(
        ax,
        [f"{s}: {row['user']}" for s, row in summary.items()],
        [
            (server, [row[server]["share"] or 0.0 for row in summary.values()])
            for server in ("stock", "ours")
        ],
    )
    for i, want in enumerate(EXPECTED_SHARE[s] for s in summary):
        if want is not None:
            ax.hlines(want, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_ylabel("share of the engine's tokens")
    ax.set_title("Judged user's share on a saturated engine (dashed: weights')")
    ax.legend()
    return save(fig, path)


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    srv = results["servers"]
    lines = [
        ABOUT,
        "",
        "| scenario | server | round | user | tok/s | share | engine tok/s "
        "| engine share | total tok/s | failed requests |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in srv["runs"]:
        user = srv["summary"][run["scenario"]]["user"]
        client, engine = run[user], run.get("engine", {}).get(user, {})
        lines.append(
            f"| {run['scenario']} | {run['server']} | {run['round'] + 1} | {user} "
            f"| {fmt(client['tok_s'], 0)} | {fmt(client['share'], 3)} "
            f"| {fmt(engine.get('tok_s'), 0)} | {fmt(engine.get('share'), 3)} "
            f"| {fmt(run['total_tok_s'], 0)} | {run['failed']} |"
        )
    lines += [
        "",
        "| scenario | target (ours) | measured | verdict |",
        "|---|---|---|---|",
        *(
            f"| {scenario} | {_target(scenario, row['user'])} "
            f"| {_measured(scenario, row)} | {verdict(share_met(scenario, row))} |"
            for scenario, row in srv["summary"].items()
        ),
        "",
        *engine_lines(results["engine"], ENGINE_TARGET),
    ]
    changes = results["batch_changes"]
    stock, ours = changes["stock"], changes["ours"]
    lines += [
        "How often the batch changes (each change costs the model runner a "
        "rebuild of its persistent batch), at scheduler level on the same load "
        f"for {changes['steps']:,} steps (`python -m benchmarks.batch_changes`): "
        f"stock {stock['changes']:,} times, ours {ours['changes']:,}, which kept "
        f"the last ranking's batch in {ours['kept_steps']:,} steps; the two "
        f"users' tokens differed by at most {stock['largest_gap']} on stock and "
        f"{ours['largest_gap']} on ours.",
        "",
        *shortcut_lines(changes),
    ]
    cost = results["ranking_cost"]
    lines += [
        f"The step when every slot is contested (no server; `PYTHONPATH=tests:. "
        f"python -m benchmarks.fair_shares --requests {cost['requests']} "
        f"--rounds {cost['rounds']}`): R = "
        f"{cost['requests']:,} resident requests, active slots R / 2, half the "
        f"users at weight 2, {cost['rounds']} shuffled rounds; the ranking's "
        "cost should grow with the users, not the requests. Plugin calls: the "
        "Python and builtin calls the plugin's code makes in a step (counted in "
        "untimed steps); they should grow with the users served in a step.",
        "",
        "| scheduler | step ms (median) | ours / stock (median) "
        "| plugin calls per step |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {row['step_ms']:.2f} | {row['ratio']:.2f} "
            f"| {_calls(row.get('plugin_calls_per_step'))} |"
            for name, row in cost["subjects"].items()
        ),
        "",
        *image("fair shares", _plot(results, figures_dir / FIGURE), md_dir),
    ]
    return "\n".join(lines)


def _calls(calls: float | None) -> str:
    """Plugin calls per step; older results did not count them."""
    return "-" if calls is None else f"{calls:,.0f}"


def shortcut_lines(changes: dict[str, Any]) -> list[str]:
    """What the kept batch and the settling beside the model save on this
    load: ours against its reference path (the same dispatches, shortcuts
    off), with stock for scale. Older results have no reference run."""
    reference = changes.get("reference")
    if reference is None:
        return []
    rows = [
        ("stock vLLM", changes["stock"]),
        ("ours (shortcuts)", changes["ours"]),
        ("ours, reference path", reference),
    ]
    return [
        "The same load's step at scheduler level (medians over the steps, one "
        "run, context only): `schedule()` is what vLLM's engine waits for "
        "before the model runs; ours settles the step in "
        "`get_grammar_bitmask()`, beside the model with the shortcuts, inside "
        "`schedule()` on the reference path.",
        "",
        "| scheduler | kept steps | schedule() µs | settling µs (beside the model) |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {row['kept_steps'] if row['kept_steps'] is not None else '-'}"
            f" | {row['schedule_us']:.1f} | {row['settle_us']:.1f} |"
            for name, row in rows
        ),
        "",
    ]
