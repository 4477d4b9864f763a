"""Section 4b of BENCHMARKS.md: light user B beside a hog with three times
``--max-num-seqs`` streams (measured by ``benchmarks.isolation_hog``)."""

from __future__ import annotations

from typing import Any

from benchmarks.isolation_hog import (
    DELIVERED_RANGE,
    HOG_STREAMS,
    MAX_NUM_SEQS,
    RATE_TARGET,
    TTFT_P95_TARGET,
)
from benchmarks.report.markdown import fmt, verdict
from benchmarks.servers import ISO_A_LIMIT


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) for the report's summary table."""
    hog = results.get("hog_summary")
    if not hog:
        return []
    o, s, met = hog["ours"], hog["stock"], hog["met"]
    return [
        (
            "4b. isolation beside a 3 x max-num-seqs hog, B / B alone",
            f"tokens/s >= {RATE_TARGET:g}, TTFT p95 <= {TTFT_P95_TARGET:g}x",
            f"{fmt(o['tok_s_ratio'], 3)} (stock: {fmt(s['tok_s_ratio'], 3)}); "
            f"TTFT p95 {fmt(o['ttft_p95_ratio'], 2)}x; hog "
            f"{fmt(o['hog_delivered_over_limit'], 3)} of its limit",
            met["tok_s"] and met["ttft_p95"] and met["hog_delivered"],
        )
    ]


def section(results: dict[str, Any]) -> list[str]:
    r = results
    runs = [row for row in r["runs"] if "hog" in row]
    if not runs:
        return []
    lines = [
        "### 4b. Beside a hog with three times `--max-num-seqs` streams",
        "",
        f"The same user B, alone and then beside user A opening {HOG_STREAMS} "
        f"streams (3 x `--max-num-seqs` {MAX_NUM_SEQS}; limit "
        f"{ISO_A_LIMIT:g} tok/s on ours), A started {r['lead_s']:g} s before B. "
        "Before issue 13, A's throttled streams held every resident slot on "
        "ours and B got nothing. The hog's delivered/limit is counted at the "
        "engine (dispatch log) over B's run; recomputed tokens are those "
        "computed again for A's requests after a preemption, per A token, "
        "from the plugin's counters; vLLM's preemptions are its own metric.",
        "",
        "| server | round | B alone tok/s | beside hog tok/s | ratio | B TTFT "
        "p50 / p95 alone ms | beside ms | p95 ratio | hog delivered / limit "
        "| preemptions (vLLM) | recomputed per hog token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in runs:
        al, be, hog = row["alone"], row["hog"]["b"], row["hog"]
        lines.append(
            f"| {row['server']} | {row['round'] + 1} | {fmt(al['tok_s'], 0)} "
            f"| {fmt(be['tok_s'], 0)} | {fmt(hog['tok_s_ratio'], 3)} "
            f"| {fmt(al['ttft_p50_ms'], 0)} / {fmt(al['ttft_p95_ms'], 0)} "
            f"| {fmt(be['ttft_p50_ms'], 0)} / {fmt(be['ttft_p95_ms'], 0)} "
            f"| {fmt(hog['ttft_p95_ratio'], 2)} "
            f"| {fmt(hog.get('hog_delivered_over_limit'), 3)} "
            f"| {fmt(hog['vllm_preemptions'], 0)} "
            f"| {fmt(hog.get('recomputed_per_hog_token'), 2)} |"
        )
    s, o, met = (
        r["hog_summary"]["stock"],
        r["hog_summary"]["ours"],
        r["hog_summary"]["met"],
    )
    lo, hi = DELIVERED_RANGE
    lines += [
        "",
        f"**With limits, B beside the hog / B alone: {fmt(o['tok_s_ratio'], 3)} "
        f"(tokens/s, target >= {RATE_TARGET:g}: {verdict(met['tok_s'])}), "
        f"{fmt(o['ttft_p95_ratio'], 2)} (TTFT p95, target <= "
        f"{TTFT_P95_TARGET:g}: {verdict(met['ttft_p95'])}); the hog got "
        f"{fmt(o['hog_delivered_over_limit'], 3)} of its limit at the engine "
        f"(target {lo:.2f}-{hi:.2f}: {verdict(met['hog_delivered'])}), with "
        f"{fmt(o['recomputed_per_hog_token'], 2)} tokens recomputed per hog "
        f"token.** Stock vLLM: {fmt(s['tok_s_ratio'], 3)} (tokens/s), "
        f"{fmt(s['ttft_p95_ratio'], 2)} (TTFT p95).",
        "",
    ]
    return lines
