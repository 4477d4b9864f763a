"""Admission at the door (``admission``'s results): the check's cost per
request, server throughput with caps not binding, and the issue's
reproduction (a throttled hog's queued streams beside a light user)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, fmt, judged

TITLE = "Admission at the door"
BAR = 0.98
ABOUT = (
    "Three real servers side by side, loaded one at a time: stock vLLM, ours "
    "with per-user caps (`--default-user-max-concurrent-requests 16`) and "
    "vLLM's `--max-num-queued-reqs 16`, and ours without the HTTP part (no "
    "admission). The check's cost is measured in process against vLLM's own "
    "`AsyncLLM.check_admission`, with requests of 100 users in flight."
)


def _light_ok(run: dict[str, Any]) -> bool:
    return run["light"]["status"] == 200


def _hog_never_503(run: dict[str, Any]) -> bool:
    return "503" not in run["hog_answers_by_status"]


def summary_rows(results: dict[str, Any]) -> list[Row]:
    ratio = results["throughput"]["ours_over_stock"]["median"]
    ours = results["reproduction"]["ours"]
    return [
        (
            "admission: server throughput, caps not binding",
            f"ours / stock >= {BAR:g}",
            judged(ratio, BAR),
            ratio >= BAR,
        ),
        (
            "admission: a light user beside a hog's paused streams",
            "light admitted (200); the hog's excess 429, never 503",
            f"light {ours['light']['status']}, hog answers "
            f"{ours['hog_answers_by_status']}",
            _light_ok(ours) and _hog_never_503(ours),
        ),
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {"admission_server": results["throughput"]["ours_over_stock"]["median"]}


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [
        ABOUT,
        "",
        "| requests in flight | vLLM's check µs | ours µs | ours with headers µs |",
        "|---:|---:|---:|---:|",
    ]
    for row in results["check_cost"]:
        lines.append(
            f"| {row['in_flight']:,} | {fmt(row['stock_us'], 2)} "
            f"| {fmt(row['ours_us'], 2)} | {fmt(row['ours_with_headers_us'], 2)} |"
        )
    tp = results["throughput"]
    rates = tp["rates_tok_s"]
    lines += [
        "",
        f"Server throughput, caps not binding ({len(rates['stock'])} rounds, each "
        "server once a round in a rotated order): ours / stock "
        f"{tp['ours_over_stock']['median']:.3f} (median; range "
        f"{tp['ours_over_stock']['min']:.2f}-{tp['ours_over_stock']['max']:.2f}); "
        "ours / ours without admission "
        f"{tp['ours_over_ours_without_admission']:.3f}.",
        "",
        "The issue's reproduction (`--max-num-seqs 32 --max-num-queued-reqs 16`; "
        "hog: 24 streams of 60 tokens at 5 tok/s on ours; light: 50 tokens 4 s "
        "later, 100 tok/s on ours; one request each, no retries):",
        "",
        "| server | light's answer | light's first token s | light's last token s "
        "| hog's answers |",
        "|---|---|---:|---:|---|",
    ]
    for name, run in results["reproduction"].items():
        light = run["light"]
        lines.append(
            f"| {name} | {light['status']} | {fmt(light['first_token_s'], 2)} "
            f"| {fmt(light['last_token_s'], 2)} | {run['hog_answers_by_status']} |"
        )
    return "\n".join([*lines, ""])
