"""4. Isolation: one light user beside a heavy user with many streams, with
and without limits; the light user's tokens/s and TTFT beside the heavy one
divided by the same alone. Then (4b, ``isolation_hog.py``) beside a heavy
user opening three times ``--max-num-seqs`` streams. Presented by
``benchmarks.report.isolation`` and ``benchmarks.report.isolation_hog``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks import isolation_hog
from benchmarks.measure import median, tokens_between, wait_until_drained
from benchmarks.noise import OthersCpu
from benchmarks.progress import fmt, log
from benchmarks.servers import (
    ISO_A,
    ISO_A_LIMIT,
    ISO_A_STREAMS,
    ISO_B,
    ISO_B_LIMIT,
    ServerPool,
)
from vllm_output_rate.loadtest import (
    LoadResult,
    LoadSpec,
    UserLoad,
    run_load,
    run_load_sync,
)

ISO_TARGET = 0.9
ISO_MAX_TOKENS = 256
ISO_LEAD_S = 3.0


async def _beside(
    url: str,
    model: str,
    duration: float,
    a_limit: float | None,
    b_limit: float | None,
    a_streams: int = ISO_A_STREAMS,
    b_window_ns: list[int] | None = None,
) -> tuple[LoadResult, LoadResult]:
    """A's streams (32 unless told) start first; B starts ISO_LEAD_S later
    and runs ``duration``. A's requests are cut by the client (request
    timeout) about two seconds after B's load ends, so a throttled A does
    not hold the run. ``b_window_ns`` receives B's start and end
    (``time.monotonic_ns``, the engine's dispatch-log clock)."""
    a_spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(ISO_A, a_streams, a_limit)],
        max_tokens=ISO_MAX_TOKENS,
        duration_s=duration + ISO_LEAD_S,
        request_timeout_s=duration + ISO_LEAD_S + 2.0,
    )
    b_spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(ISO_B, 1, b_limit)],
        max_tokens=ISO_MAX_TOKENS,
        duration_s=duration,
    )

    async def b_later() -> LoadResult:
        await asyncio.sleep(ISO_LEAD_S)
        if b_window_ns is not None:
            b_window_ns.append(time.monotonic_ns())
        result = await run_load(b_spec)
        if b_window_ns is not None:
            b_window_ns.append(time.monotonic_ns())
        return result

    a, b = await asyncio.gather(run_load(a_spec), b_later())
    return a, b


def _beside_hog(
    pool: ServerPool,
    name: str,
    duration: float,
    a_limit: float | None,
    b_limit: float | None,
) -> dict[str, Any]:
    """B beside A opening 3 x --max-num-seqs streams (isolation_hog.py)."""
    url = pool.url(name)
    pool.settle()
    before = isolation_hog.counters(url)
    window: list[int] = []
    _, b_result = asyncio.run(
        _beside(
            url,
            pool.model,
            duration,
            a_limit,
            b_limit,
            a_streams=isolation_hog.HOG_STREAMS,
            b_window_ns=window,
        )
    )
    after = isolation_hog.settle_counters(url)
    wait_until_drained(url)
    log_path = pool.dispatch_log_path if name == "ours" else None
    return {
        "b": _b_summary(b_result),
        **isolation_hog.hog_figures(before, after, window, log_path),
    }


def _b_summary(result: LoadResult) -> dict[str, Any]:
    u = result.user(ISO_B)
    return {
        "tok_s": u.rate_tok_s,
        "ttft_p50_ms": u.ttft_p50_ms,
        "ttft_p95_ms": u.ttft_p95_ms,
        "tokens": u.tokens_client,
        "requests": u.requests_completed,
        "failed": u.requests_failed,
    }


def isolation(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """User B (1 stream, limit 10000 on ours) alone, then beside user A (32
    streams, limit 10 tok/s on ours, none on stock), on both servers. Per
    server and round: B beside A / B alone, for tokens/s (B's first-to-last
    token span rate) and TTFT p50. Rounds alternate the servers; the figure
    is the median over rounds."""
    rounds = 1 if quick else 3
    duration = 8.0 if quick else 12.0
    model = pool.model
    pool.start("stock", "ours")
    runs = []
    # Per server, the first round's A and B-beside-A loads, request by
    # request (LoadResult.to_dict), for the report's timeline figure.
    timelines: dict[str, dict[str, Any]] = {}
    for i in range(rounds):
        order = ("stock", "ours") if i % 2 == 0 else ("ours", "stock")
        for name in order:
            url = pool.url(name)
            limited = name == "ours"
            b_limit = ISO_B_LIMIT if limited else None
            a_limit = ISO_A_LIMIT if limited else None
            wait_until_drained(url)
            pool.settle()
            with OthersCpu() as others_alone:
                alone = run_load_sync(
                    LoadSpec(
                        base_url=url,
                        model=model,
                        users=[UserLoad(ISO_B, 1, b_limit)],
                        max_tokens=ISO_MAX_TOKENS,
                        duration_s=duration,
                    )
                )
            wait_until_drained(url)
            pool.settle()
            with OthersCpu() as others_beside:
                a_result, b_result = asyncio.run(
                    _beside(url, model, duration, a_limit, b_limit)
                )
            wait_until_drained(url)
            hog = _beside_hog(pool, name, duration, a_limit, b_limit)
            a_user = a_result.user(ISO_A)
            # A's rate while B ran (client time of A's run: B starts at lead).
            a_window = tokens_between(
                a_result, ISO_A, ISO_LEAD_S, ISO_LEAD_S + duration
            )
            row = {
                "round": i,
                "server": name,
                "alone": _b_summary(alone),
                "beside": _b_summary(b_result),
                "a_tok_s_while_b": a_window / duration,
                "a_tokens": a_user.tokens_client,
                "a_requests_completed": a_user.requests_completed,
                "a_requests_cut": a_user.requests_failed,
                "others_cores_alone": others_alone.cores,
                "others_cores_beside": others_beside.cores,
            }
            al, be = row["alone"], row["beside"]
            row["hog"] = {**hog, **isolation_hog.ratios(al, hog["b"])}
            row["tok_s_ratio"] = (
                (be["tok_s"] or 0.0) / al["tok_s"] if al["tok_s"] else None
            )
            row["ttft_ratio"] = (
                be["ttft_p50_ms"] / al["ttft_p50_ms"]
                if be["ttft_p50_ms"] is not None and al["ttft_p50_ms"]
                else None
            )
            runs.append(row)
            timelines.setdefault(
                name, {"A": a_result.to_dict(), "B beside A": b_result.to_dict()}
            )
            log(
                f"isolation round {i + 1}/{rounds} {name}: B alone "
                f"{fmt(al['tok_s'], 0)} tok/s, beside A {fmt(be['tok_s'], 0)} "
                f"tok/s (ratio {fmt(row['tok_s_ratio'], 3)}); A "
                f"{row['a_tok_s_while_b']:,.0f} tok/s; beside the hog "
                f"{fmt(row['hog']['b']['tok_s'], 0)} tok/s (ratio "
                f"{fmt(row['hog']['tok_s_ratio'], 3)}), hog delivered/limit "
                f"{fmt(row['hog'].get('hog_delivered_over_limit'), 3)}"
            )
    summary = {}
    for name in ("stock", "ours"):
        mine = [r for r in runs if r["server"] == name]
        summary[name] = {
            "tok_s_ratio": median(r["tok_s_ratio"] for r in mine),
            "ttft_ratio": median(r["ttft_ratio"] for r in mine),
            "a_tok_s_while_b": median(r["a_tok_s_while_b"] for r in mine),
        }
    ours_ratio = summary["ours"]["tok_s_ratio"]
    return {
        "quick": quick,
        "rounds": rounds,
        "duration_s": duration,
        "lead_s": ISO_LEAD_S,
        "max_tokens": ISO_MAX_TOKENS,
        "a_streams": ISO_A_STREAMS,
        "a_limit": ISO_A_LIMIT,
        "b_limit": ISO_B_LIMIT,
        "runs": runs,
        "summary": summary,
        "hog_summary": isolation_hog.summarize(runs),
        "target": ISO_TARGET,
        "met": ours_ratio is not None and ours_ratio >= ISO_TARGET,
        "timelines": timelines,
    }
