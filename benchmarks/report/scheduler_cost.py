"""The scheduler step cost (``scheduler_cost``'s results): one table per
state, the targets, and a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, image, pyplot, save, verdict

TITLE = "Scheduler step cost"
FIGURE = "scheduler_cost.png"
TARGETS = {
    "a_within_5_percent_of_stock": "step cost, nobody throttled: within 5 % of stock",
    "b_not_above_stock": "step cost, all throttled: not above stock",
    "limiter_calls_grow_with_U_not_R": "limiter calls grow with users, not requests",
    "r_reference_path": "step cost, nobody throttled, shortcuts off (reported)",
}


def summary_rows(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for key, target in results["targets"].items():
        measured = (
            f"worst ratio {target['worst_ratio']:.3f}"
            if "worst_ratio" in target
            else "see table"
        )
        rows.append(
            ("scheduler step", TARGETS.get(key, key), measured, target.get("met"))
        )
    return rows


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    worst = results["targets"]["a_within_5_percent_of_stock"]["worst_ratio"]
    return {"step": worst}


def _series(
    results: dict[str, Any], state: str, users: int, key: str
) -> list[tuple[int, float]]:
    """(R, row[key]) of one state and user count, by R."""
    return sorted(
        (r["R"], r[key])
        for r in results["rows"]
        if r["state"] == state and r["U"] == users
    )


def plot(results: dict[str, Any], path: Path) -> Path:
    """µs per schedule() against R: one panel per state, one line per U, and
    the ratios ours / stock."""
    plt = pyplot()
    states = results["meta"]["states"]
    user_counts = results["meta"]["user_counts"]
    fig, axes = plt.subplots(1, len(states) + 1, figsize=(20, 4.8))
    stock = sorted(results["stock"], key=lambda s: s["R"])
    for ax in axes[1 : len(states)]:
        ax.sharey(axes[0])
    for ax, (state, title) in zip(axes, states.items(), strict=False):
        ax.plot(
            [s["R"] for s in stock],
            [s["schedule_us"] for s in stock],
            "k--o",
            label="stock vLLM (all R decode)",
        )
        for users in user_counts:
            if points := _series(results, state, users, "ours_us"):
                ax.plot(*zip(*points, strict=True), "-o", label=f"ours, U={users}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"({state}) {title}")
        ax.set_xlabel("resident requests R")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ratio_ax = axes[len(states)]
    for state in states:
        for users in user_counts:
            if points := _series(results, state, users, "ratio"):
                ratio_ax.plot(
                    *zip(*points, strict=True), "-o", label=f"({state}) U={users}"
                )
    limit = results["targets"]["a_within_5_percent_of_stock"]["limit"]
    ratio_ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ratio_ax.axhline(limit, color="r", linestyle=":", linewidth=1)
    ratio_ax.set_xscale("log", base=2)
    ratio_ax.set_title("ours / stock (median of per-round ratios)")
    ratio_ax.set_xlabel("resident requests R")
    ratio_ax.grid(True, which="both", alpha=0.3)
    ratio_ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel("µs per schedule() (median)")
    fig.suptitle("Scheduler step cost: output-rate scheduler vs stock vLLM")
    return save(fig, path)


def section(
    results: dict[str, Any], figures_dir: Path | None, md_dir: Path | None = None
) -> str:
    """One table per state, the targets, and the figure (written to
    ``figures_dir``; none without one)."""
    meta = results["meta"]
    lines = [
        f"Ours = `{meta['scheduler']}`. "
        "Real V1 scheduler and KV cache manager, no "
        "model; synchronous scheduling; R requests resident and decoding, spread "
        "round-robin over U users. Times are medians over rounds (timed steps per "
        "scheduler: "
        + ", ".join(f"R={r}: {n}" for r, n in meta["rounds"].items())
        + "); the ratio is the median over rounds of ours / stock in the same "
        "round (interquartile range in brackets). Stock vLLM decodes all R "
        "requests in every state.",
        "",
    ]
    for state, title in meta["states"].items():
        rows = sorted(
            (r for r in results["rows"] if r["state"] == state),
            key=lambda r: (r["R"], r["U"]),
        )
        if not rows:
            continue
        lines += [
            f"### ({state}) {title}",
            "",
            "| R | U | decoding | ours µs | stock µs | ratio | limiter calls/step "
            "| ours update µs | stock update µs |",
            "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['R']} | {r['U']} | {r['scheduled_per_step']:.0f} "
                f"| {r['ours_us']:,.0f} | {r['stock_us']:,.0f} "
                f"| {r['ratio']:.3f} [{r['ratio_q1']:.2f}–{r['ratio_q3']:.2f}] "
                f"| {r['limiter_calls_per_step']:.1f} "
                f"| {r['ours_update_us']:,.0f} | {r['stock_update_us']:,.0f} |"
            )
        lines.append("")
    targets = results["targets"]
    a = targets["a_within_5_percent_of_stock"]
    g = targets["limiter_calls_grow_with_U_not_R"]
    b = targets["b_not_above_stock"]
    calls = "; ".join(
        f"({state}) "
        + ", ".join(
            f"U={u}: {'/'.join(f'{c:g}' for c in per_r)}" for u, per_r in per_u.items()
        )
        for state, per_u in g["calls_per_step_by_state_and_U"].items()
    )
    lines += [
        "### Targets",
        "",
        f"- Nobody throttled, within 5 % of stock: {verdict(a['met'])} "
        f"(worst ratio {a['worst_ratio']:.3f}).",
        f"- Limiter work grows with U, not R: {verdict(g['met'])} "
        f"(limiter calls per step for increasing R: {calls}).",
        f"- Fully throttled step no dearer than a stock step: {verdict(b['met'])} "
        f"(worst ratio {b['worst_ratio']:.3f}).",
        *reference_line(targets),
        "",
    ]
    if figures_dir is not None:
        figure = plot(results, figures_dir / FIGURE)
        lines += image("µs per schedule() against R", figure, md_dir or figures_dir)
    return "\n".join(lines)


def reference_line(targets: dict[str, Any]) -> list[str]:
    """What the shortcuts save with nobody throttled (results before the
    reference state existed have none)."""
    r = targets.get("r_reference_path")
    if r is None:
        return []
    return [
        "- Reported: the same steps on the reference path, shortcuts off "
        f"(state r; worst ratio to stock {r['worst_ratio']:.3f}): what "
        "vLLM's own hook in uncontested steps saves "
        "([architecture](docs/architecture.md#shortcuts))."
    ]
