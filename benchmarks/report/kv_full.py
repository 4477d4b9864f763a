"""Fair shares with the KV cache full (``kv_full``'s results): requests
scheduled a step, tokens sampled and preemptions, ours against stock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, fmt

TITLE = "Fair shares with the KV cache full"
ABOUT = (
    "vLLM's real scheduler and KV cache manager, no model: {requests:,} "
    "resident requests, {active:,} active slots, room for {blocks} KV blocks "
    "a request, each request growing a token a step, limits far above demand. "
    "The cache fills after ~190 of the {steps} steps: vLLM preempts, and the "
    "preempted requests wait to compute their tokens again. Requests a step "
    "over the last {judged} steps; tokens sampled, and tokens computed "
    "(what a preemption makes the model compute again included), over all "
    "of them."
)


def _ours(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: f for n, f in results["subjects"].items() if n != "stock"}


def _worst(results: dict[str, Any]) -> float:
    return min(f["sampled_over_stock"] for f in _ours(results).values())


def summary_rows(results: dict[str, Any]) -> list[Row]:
    ratios = " / ".join(
        f"{fmt(f['sampled_over_stock'], 3)} ({name})"
        for name, f in _ours(results).items()
    )
    return [
        (
            "KV cache full: tokens sampled, ours / stock, at each U",
            ">= 1.0",
            ratios,
            _worst(results) >= 1.0,
        )
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {"kv_full_sampled": _worst(results)}


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [
        ABOUT.format(
            requests=results["requests"],
            active=results["active"],
            blocks=results["blocks_per_request"],
            steps=results["steps"],
            judged=results["judged_steps"],
        ),
        "",
        "| subject | requests a step: mean | least | tokens sampled "
        "| ours / stock | tokens computed | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in results["subjects"].items():
        lines.append(
            f"| {name} | {fmt(f['scheduled_per_step'], 1)} "
            f"| {f['least_per_step']:,} | {f['sampled']:,} "
            f"| {fmt(f['sampled_over_stock'], 3)} | {f['computed']:,} "
            f"| {f['preemptions']:,} |"
        )
    return "\n".join([*lines, ""])
