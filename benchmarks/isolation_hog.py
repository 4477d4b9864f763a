"""4b. Isolation against a hog with three times ``--max-num-seqs`` streams.

Issue 13: a throttled user with more streams than the engine has resident
slots must not lock anyone out. ``isolation.py`` runs the load (user B alone,
then beside A opening ``HOG_STREAMS`` streams); this module turns one such
run into figures (measuring) and writes the report section (presenting):

* B's tokens/s and TTFT p50/p95 beside the hog against B alone;
* the hog's delivered/limit at the engine, from the scheduler's dispatch log
  over B's run (ours only: stock has no limit);
* the recompute overhead: tokens computed again after preemptions per hog
  token, from the plugin's counters on ``/metrics`` (ours), and vLLM's own
  preemption count (both servers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report_format import fmt, median, verdict
from benchmarks.servers import ISO_A, ISO_A_LIMIT, SERVER_ARGS
from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

MAX_NUM_SEQS = int(SERVER_ARGS[SERVER_ARGS.index("--max-num-seqs") + 1])
HOG_STREAMS = 3 * MAX_NUM_SEQS
RATE_TARGET = 0.9  # B beside the hog / B alone, tokens/s
TTFT_P95_TARGET = 2.0  # B beside the hog / B alone, at most
DELIVERED_RANGE = (1.00, 1.02)  # the hog at the engine, delivered / limit
# The API server refreshes the plugin's counters once a second.
METRICS_REFRESH_S = 2.5

OURS = "vllm:output_rate_"
COUNTERS = {
    "admitted": f'{OURS}tokens_admitted_total{{user="{ISO_A}"}}',
    "reclaimed": f'{OURS}reclaimed_total{{user="{ISO_A}"}}',
    "recomputed": f'{OURS}recomputed_tokens_total{{user="{ISO_A}"}}',
}
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"


# ----- measuring ----------------------------------------------------------------


def counters(url: str) -> dict[str, float]:
    """The plugin's counters for the hog, and vLLM's preemptions (all)."""
    values: dict[str, float] = dict.fromkeys(COUNTERS.values(), 0.0)
    values[VLLM_PREEMPTIONS] = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name in values:
            values[name] = float(value)
        elif name.startswith(VLLM_PREEMPTIONS + "{"):
            values[VLLM_PREEMPTIONS] += float(value)
    return values


def settle_counters(url: str) -> dict[str, float]:
    time.sleep(METRICS_REFRESH_S)
    return counters(url)


def hog_figures(
    before: dict[str, float],
    after: dict[str, float],
    window_ns: list[int],
    dispatch_log: Path | None,
) -> dict[str, Any]:
    """Engine-side figures of one run beside the hog (``window_ns``: B's
    start and end on the engine's clock)."""
    figures: dict[str, Any] = {
        "vllm_preemptions": after[VLLM_PREEMPTIONS] - before[VLLM_PREEMPTIONS]
    }
    if dispatch_log is None:
        return figures  # stock: no limit, no dispatch log, no counters
    start_ns, end_ns = window_ns
    times = read_dispatch_log(str(dispatch_log)).get(ISO_A, [])
    in_window = sum(start_ns <= t < end_ns for t in times)
    window_s = (end_ns - start_ns) / 1e9
    delta = {key: after[name] - before[name] for key, name in COUNTERS.items()}
    figures.update(
        hog_tokens_in_b_window=in_window,
        b_window_s=window_s,
        hog_delivered_over_limit=in_window / (window_s * ISO_A_LIMIT),
        hog_tokens=delta["admitted"],
        reclaimed=delta["reclaimed"],
        recomputed_tokens=delta["recomputed"],
        recomputed_per_hog_token=(
            delta["recomputed"] / delta["admitted"] if delta["admitted"] else None
        ),
    )
    return figures


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per server, and whether each target was met."""
    summary: dict[str, Any] = {}
    for name in ("stock", "ours"):
        rows = [r for r in runs if r["server"] == name and "hog" in r]
        summary[name] = {
            "tok_s_ratio": median(r["hog"]["tok_s_ratio"] for r in rows),
            "ttft_p95_ratio": median(r["hog"]["ttft_p95_ratio"] for r in rows),
            "hog_delivered_over_limit": median(
                r["hog"].get("hog_delivered_over_limit") for r in rows
            ),
            "recomputed_per_hog_token": median(
                r["hog"].get("recomputed_per_hog_token") for r in rows
            ),
        }
    o = summary["ours"]
    lo, hi = DELIVERED_RANGE
    delivered = o["hog_delivered_over_limit"]
    summary["met"] = {
        "tok_s": o["tok_s_ratio"] is not None and o["tok_s_ratio"] >= RATE_TARGET,
        "ttft_p95": o["ttft_p95_ratio"] is not None
        and o["ttft_p95_ratio"] <= TTFT_P95_TARGET,
        "hog_delivered": delivered is not None
        and round(delivered, 2) >= lo
        and round(delivered, 2) <= hi,
    }
    return summary


def ratios(alone: dict[str, Any], beside: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        a, b = alone.get(key), beside.get(key)
        return b / a if a and b is not None else None

    return {"tok_s_ratio": ratio("tok_s"), "ttft_p95_ratio": ratio("ttft_p95_ms")}


# ----- presenting ----------------------------------------------------------------


def format_section(results: dict[str, Any]) -> list[str]:
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
