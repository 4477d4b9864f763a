"""4b. Isolation against a hog with three times ``--max-num-seqs`` streams.

Issue 13: a throttled user with more streams than the engine has resident
slots must not lock anyone out. ``isolation.py`` runs the load (user B alone,
then beside A opening ``HOG_STREAMS`` streams); this module turns one such
run into figures; ``benchmarks.report.isolation_hog`` presents them:

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

from benchmarks.measure import median
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
