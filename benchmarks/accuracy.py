"""Rate accuracy: measured rate / limit for several limits and stream counts
on ours, client side and engine side (the scheduler's dispatch log), and the
gaps between a user's consecutive tokens as the scheduler dispatched them.

Cells (limit, streams) run as distinct users, several at once (batches whose
limits sum to at most ``ACC_BATCH_DEMAND``), each batch beside a probe: one
unthrottled stream, whose rate is what each stream of a cell could get, so
a cell's demand exceeds its limit when streams x probe rate >=
``DEMAND_MARGIN`` x limit. Each stream sends one request longer than the run,
cut at the deadline, so a user's demand never pauses.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.measure import log, tokens_between, wait_until_drained
from benchmarks.servers import (
    ACC_LIMITS,
    ACC_STREAMS,
    QUICK_ACC_STREAMS,
    ServerPool,
    acc_user,
)
from vllm_output_rate.loadtest import (
    LoadResult,
    LoadSpec,
    UserLoad,
    run_load,
    run_load_sync,
)
from vllm_output_rate.loadtest.summary import percentile
from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

# Cells run concurrently on one server in batches whose summed limits stay
# at or under this: the tiny model decodes 3,000-6,000 tok/s with 32 streams
# here at best, but only a few hundred when vLLM's CPU processes fall into
# the slow state described in BENCHMARKS.md (which happens often here).
ACC_BATCH_DEMAND = 500.0
ACC_MAX_TOKENS_CAP = 3500  # --max-model-len 4096 minus the prompt, with room

ACC_SKIP_S = 1.0  # engine side: leave out the first second (initial burst)
ACC_CUT_AFTER_S = 0.5
PROBE_USER = "acc-probe"  # 1 stream at the default limit, beside each batch
FLUSH_USER = "acc-flush"
DEMAND_MARGIN = 1.5  # judged if streams x probe rate >= 1.5 x limit


def acc_max_tokens(limit: float, streams: int, duration: float) -> int:
    """More than one stream can get at the limit during the whole run, so
    that each stream's single request is still open at the deadline (the
    client then cuts it): the user's demand never pauses between requests."""
    value = math.ceil(1.2 * limit * duration / streams) + 2
    return int(min(ACC_MAX_TOKENS_CAP, value))


def plan_batches(
    cells: Sequence[tuple[float, int]], cap: float = ACC_BATCH_DEMAND
) -> list[list[tuple[float, int]]]:
    """Pack cells (limit, streams) into batches whose summed limits stay at
    or under ``cap`` (first fit, largest first; a cell above ``cap`` alone)."""
    batches: list[list[tuple[float, int]]] = []
    for cell in sorted(cells, key=lambda c: (-c[0], -c[1])):
        for batch in batches:
            if sum(c[0] for c in batch) + cell[0] <= cap:
                batch.append(cell)
                break
        else:
            batches.append([cell])
    return batches


async def _run_batch(
    url: str, model: str, batch: Sequence[tuple[float, int]], duration: float
) -> tuple[list[LoadResult], LoadResult]:
    specs = [
        LoadSpec(
            base_url=url,
            model=model,
            users=[UserLoad(acc_user(limit, streams), streams, float(limit))],
            max_tokens=acc_max_tokens(limit, streams, duration),
            duration_s=duration,
            # Cut at the deadline: no tail, and no pause in demand.
            request_timeout_s=duration + ACC_CUT_AFTER_S,
        )
        for limit, streams in batch
    ]
    probe = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(PROBE_USER, 1)],
        max_tokens=256,
        duration_s=duration,
    )
    *cells, probe_result = await asyncio.gather(*(run_load(s) for s in [*specs, probe]))
    return list(cells), probe_result


def _engine_stats(
    times_ns: Sequence[int], start_ns: int, duration: float, limit: float
) -> dict[str, Any]:
    """Engine-side rate and gaps from a user's dispatch times, within
    [first dispatch + ACC_SKIP_S, run start + duration]."""
    out: dict[str, Any] = {"dispatched": len(times_ns), "ideal_gap_ms": 1000.0 / limit}
    if not times_ns:
        return out
    lo = times_ns[0] + int(ACC_SKIP_S * 1e9)
    hi = start_ns + int(duration * 1e9)
    window = [t for t in times_ns if lo <= t <= hi]
    out["in_window"] = len(window)
    if len(window) >= 2:
        span_s = (window[-1] - window[0]) / 1e9
        out["rate"] = (len(window) - 1) / span_s if span_s > 0 else None
        gaps_ms = [(b - a) / 1e6 for a, b in itertools.pairwise(window)]
        out["gap_p50_ms"] = percentile(gaps_ms, 50)
        out["gap_p99_ms"] = percentile(gaps_ms, 99)
        out["gap_max_ms"] = max(gaps_ms)
        out["same_step_share"] = sum(1 for g in gaps_ms if g == 0) / len(gaps_ms)
    return out


def _flush_dispatch_log(url: str, model: str) -> None:
    """Push more than FLUSH_EVERY (4,096) tokens through the server so the
    scheduler's dispatch log writes out every line recorded before them:
    the log is written in batches and the engine process may not run its
    exit handlers when the server is stopped."""
    run_load_sync(
        LoadSpec(
            base_url=url,
            model=model,
            users=[UserLoad(FLUSH_USER, 8)],
            max_tokens=600,
            duration_s=0.2,
        )
    )


def accuracy(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """Every cell on ours (module docstring): per cell the client-side span
    rate (the load tool's), and the engine-side rate and gaps."""
    duration = 8.0 if quick else 20.0
    streams_set = QUICK_ACC_STREAMS if quick else ACC_STREAMS
    cells = [(limit, s) for limit in ACC_LIMITS for s in streams_set]
    batches = plan_batches(cells)
    model = pool.model
    url = pool.url("ours")
    rows: dict[tuple[float, int], dict[str, Any]] = {}
    probes = []
    for k, batch in enumerate(batches):
        wait_until_drained(url)
        pool.settle()
        start_ns = time.monotonic_ns()
        results, probe = asyncio.run(_run_batch(url, model, batch, duration))
        probe_rate = tokens_between(probe, PROBE_USER, 1.0, duration) / (duration - 1)
        probes.append(probe_rate)
        for (limit, streams), result in zip(batch, results, strict=True):
            name = acc_user(limit, streams)
            u = result.user(name)
            # Requests are cut at the deadline, so the span has no tail.
            client = u.rate_tok_s
            rows[(limit, streams)] = {
                "limit": limit,
                "streams": streams,
                "user": name,
                "batch": k,
                "start_ns": start_ns,
                "max_tokens": result.spec.max_tokens,
                "tokens": u.tokens_client,
                "requests_cut_or_failed": u.requests_failed,
                "client_rate": client,
                "client_ratio": client / limit if client else None,
                "bound_ok": u.bound_ok,
                "probe_tok_s": probe_rate,
                "demand_exceeds_limit": streams * probe_rate >= DEMAND_MARGIN * limit,
            }
        log(
            f"accuracy batch {k + 1}/{len(batches)} (probe {probe_rate:,.0f} tok/s) "
            + ", ".join(
                f"{acc_user(*c)}={rows[c]['client_ratio'] or 0:.3f}" for c in batch
            )
        )
    _flush_dispatch_log(url, model)
    pool.stop("ours")
    engine_ok = pool.dispatch_log_path.exists()
    dispatch = read_dispatch_log(str(pool.dispatch_log_path)) if engine_ok else {}
    for row in rows.values():
        stats = _engine_stats(
            dispatch.get(row["user"], []), row["start_ns"], duration, row["limit"]
        )
        row["engine"] = stats
        row["engine_complete"] = stats["dispatched"] >= row["tokens"]
        rate = stats.get("rate")
        row["engine_ratio"] = rate / row["limit"] if rate else None
    return {
        "duration_s": duration,
        "batches": [[acc_user(*c) for c in b] for b in batches],
        "batch_demand_cap": ACC_BATCH_DEMAND,
        "max_tokens_cap": ACC_MAX_TOKENS_CAP,
        "skip_s": ACC_SKIP_S,
        "demand_margin": DEMAND_MARGIN,
        "probe_tok_s": probes,
        "rows": [rows[c] for c in cells],
        "dispatch_log_read": engine_ok,
    }
