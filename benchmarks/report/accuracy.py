"""Rate accuracy (``accuracy``'s results): rate / limit per cell, client
and engine side, the gaps between a user's tokens, with a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, fmt, image, pyplot, save, verdict

TITLE = "Rate accuracy"
FIGURE = "accuracy.png"
TARGET = (1.00, 1.02)  # engine rate / limit, rounded to two decimals


def cell_met(row: dict[str, Any]) -> bool | None:
    """Judged where demand exceeds the limit: the engine's rate within the
    target, and the client never above the article's bound."""
    if not row["demand_exceeds_limit"] or row["engine_ratio"] is None:
        return None
    return (
        TARGET[0] <= round(row["engine_ratio"], 2) <= TARGET[1]
        and row["bound_ok"] is not False
    )


def _judged(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["rows"] if cell_met(r) is not None]


def summary_rows(results: dict[str, Any]) -> list[Row]:
    judged = _judged(results)
    engine = [r["engine_ratio"] for r in judged]
    client = [r["client_ratio"] for r in judged if r["client_ratio"] is not None]
    within = sum(r["bound_ok"] is not False for r in judged)
    measured = (
        f"engine {min(engine):.3f} to {max(engine):.3f} over {len(judged)} cells; "
        f"client {min(client):.3f} to {max(client):.3f}, within the bound in "
        f"{within} of {len(judged)}"
        if engine and client
        else "no cell judged"
    )
    return [
        (
            "rate accuracy (rate / limit)",
            f"engine {TARGET[0]:.2f} to {TARGET[1]:.2f} where demand > limit; "
            "client within the article's bound",
            measured,
            bool(judged) and all(cell_met(r) for r in judged),
        )
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    """The judged engine rate / limit farthest from 1."""
    engine = [r["engine_ratio"] for r in _judged(results)]
    return {"accuracy": max(engine, key=lambda x: abs(x - 1)) if engine else None}


def _plot(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    rows = results["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['limit']:g}x{r['streams']}" for r in rows]
    xs = list(range(len(rows)))
    ax = axes[0]
    ax.bar(
        [x - 0.2 for x in xs],
        [r["client_ratio"] or 0 for r in rows],
        0.4,
        label="client",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["engine_ratio"] or 0 for r in rows],
        0.4,
        label="engine",
    )
    ax.axhspan(*TARGET, color="g", alpha=0.15, label="target 1.00-1.02")
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("measured rate / limit")
    ax = axes[1]
    ax.plot(
        xs,
        [r["engine"].get("ideal_gap_ms") for r in rows],
        "k_",
        markersize=14,
        label="1 / limit",
    )
    ax.plot(xs, [r["engine"].get("gap_p50_ms") for r in rows], "o", label="p50")
    ax.plot(xs, [r["engine"].get("gap_p99_ms") for r in rows], "^", label="p99")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylabel("engine-side gap between a user's tokens (ms)")
    for ax in axes:
        ax.set_xticks(xs, labels, rotation=45, fontsize=8)
        ax.set_xlabel("limit tok/s x streams")
        ax.legend(fontsize=8)
    fig.suptitle("Rate accuracy")
    return save(fig, path)


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r = results
    lines = [
        "Each cell is one user with that limit and that many streams on ours, "
        f"{r['duration_s']:g} s of load; each stream sends one request longer "
        "than the run (at most "
        f"{r['max_tokens_cap']} tokens), cut at the deadline, so the user's "
        "demand never pauses. Cells run in batches whose limits sum to at most "
        f"{r['batch_demand_cap']:g} tok/s, each beside a probe (one stream, no "
        "binding limit; rates "
        + ", ".join(f"{p:,.0f}" for p in r["probe_tok_s"])
        + " tok/s): vLLM gives every decoding request a token a step, so a "
        "cell's demand exceeds its limit, and it is judged, when streams x "
        f"probe rate >= {r['demand_margin']:g} x limit. **engine** = the "
        "scheduler's own count (its dispatch log) from the first dispatch + "
        f"{r['skip_s']:g} s (after the 100 ms burst) to the deadline, the exact "
        "rate; it is judged, rounded to two decimals. **client** = the load "
        "tool's first-to-last-token rate, which carries the HTTP front end's "
        "delivery lag (it drifts by up to 0.5 s over a run here); the client "
        "must stay within the article's bound ((W + 0.1 s) x limit + 1). Gaps "
        "are between a user's consecutive dispatched tokens (0 within a step).",
        "",
        "| limit | streams | tokens | client / limit | engine / limit "
        "| gap p50 ms | gap p99 ms | 1/limit ms | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        e, met = row["engine"], cell_met(row)
        target = verdict(met) if met is not None else "n.a. (demand < limit)"
        lines.append(
            f"| {row['limit']:g} | {row['streams']} | {row['tokens']:,} "
            f"| {fmt(row['client_ratio'], 3)} | {fmt(row['engine_ratio'], 3)} "
            f"| {fmt(e.get('gap_p50_ms'), 1)} | {fmt(e.get('gap_p99_ms'), 1)} "
            f"| {fmt(e.get('ideal_gap_ms'), 1)} | {target} |"
        )
    judged = _judged(r)
    missed = [f"{x['limit']:g}x{x['streams']}" for x in judged if not cell_met(x)]
    lines += [
        "",
        f"**Engine rate / limit in [{TARGET[0]:.2f}, {TARGET[1]:.2f}] and the "
        f"client within the bound: {len(judged) - len(missed)} of {len(judged)} "
        "judged cells**" + (f" (missed: {', '.join(missed)})" if missed else "") + ".",
        "",
    ]
    if not r["dispatch_log_read"]:
        lines += ["(The dispatch log was missing: no engine-side figures.)", ""]
    lines += image("rate accuracy", _plot(r, figures_dir / FIGURE), md_dir)
    return "\n".join(lines)
