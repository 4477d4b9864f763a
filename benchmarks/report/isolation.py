"""Isolation (``isolation``'s results): the light user B alone and beside
the heavy user A, per server and round, with a figure."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.report.format import (
    Row,
    fmt,
    grouped_bars,
    image,
    pyplot,
    save,
    verdict,
)

TITLE = "Isolation"
FIGURE = "isolation.png"
RATE_TARGET = 0.9  # B beside A / B alone, tokens/s


def summary_rows(results: dict[str, Any]) -> list[Row]:
    o, s = results["summary"]["ours"], results["summary"]["stock"]
    return [
        (
            "isolation, B beside A / B alone",
            f"tokens/s >= {RATE_TARGET:g}",
            f"{fmt(o['tok_s_ratio'], 3)} (stock {fmt(s['tok_s_ratio'], 3)}); "
            f"TTFT p50 {fmt(o['ttft_ratio'], 2)}x (stock {fmt(s['ttft_ratio'], 2)}x)",
            (o["tok_s_ratio"] or 0.0) >= RATE_TARGET,
        )
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {"isolation": results["summary"]["ours"]["tok_s_ratio"]}


def _plot(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names, labels = ("stock", "ours"), ["stock vLLM", "with limits"]
    for ax, (key, ylabel) in zip(
        axes, (("tok_s", "B tokens/s"), ("ttft_p50_ms", "B TTFT p50 (ms)")), strict=True
    ):
        grouped_bars(
            ax,
            labels,
            [
                (
                    phase,
                    [
                        median(
                            [r[phase][key] for r in results["runs"] if r["server"] == n]
                        )
                        for n in names
                    ],
                )
                for phase in ("alone", "beside")
            ],
        )
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle("Isolation: light user B alone and beside heavy user A")
    return save(fig, path)


def median(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else 0.0


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r, o, s = results, results["summary"]["ours"], results["summary"]["stock"]
    lines = [
        f"User B: 1 stream x {r['max_tokens']} tokens (limit {r['b_limit']:g} "
        f"tok/s on ours), {r['duration_s']:g} s, alone, then beside user A: "
        f"{r['a_streams']} streams (limit {r['a_limit']:g} tok/s on ours) started "
        f"{r['lead_s']:g} s before B. Stock gets the same load without limits. "
        "B's tokens/s is its first-to-last-token rate; TTFT, timed by the "
        "client, includes the API server's HTTP path (often hundreds of ms for a "
        f"lone stream here, on either server). {r['rounds']} round(s), servers "
        "alternating; figures are medians over rounds.",
        "",
        "| server | round | B alone tok/s | B beside A tok/s | ratio "
        "| TTFT p50 alone ms | beside ms | ratio | A tok/s beside B |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["runs"]:
        al, be = row["alone"], row["beside"]
        lines.append(
            f"| {row['server']} | {row['round'] + 1} | {fmt(al['tok_s'], 0)} "
            f"| {fmt(be['tok_s'], 0)} | {fmt(row['tok_s_ratio'], 3)} "
            f"| {fmt(al['ttft_p50_ms'], 0)} | {fmt(be['ttft_p50_ms'], 0)} "
            f"| {fmt(row['ttft_ratio'], 2)} | {fmt(row['a_tok_s_while_b'], 0)} |"
        )
    met = (o["tok_s_ratio"] or 0.0) >= RATE_TARGET
    lines += [
        "",
        f"**With limits, B beside A / B alone: {fmt(o['tok_s_ratio'], 3)}** "
        f"(target >= {RATE_TARGET:g}: {verdict(met)}; TTFT p50 "
        f"{fmt(o['ttft_ratio'], 2)}x). Stock: {fmt(s['tok_s_ratio'], 3)}, with A "
        f"taking {fmt(s['a_tok_s_while_b'], 0)} tok/s against ours' "
        f"{fmt(o['a_tok_s_while_b'], 0)}. A hog with more streams than the "
        "engine has slots is tested not to lock B out (`tests/e2e/test_lockout.py`).",
        "",
        *image("isolation", _plot(r, figures_dir / FIGURE), md_dir),
    ]
    return "\n".join(lines)
