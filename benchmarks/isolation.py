"""Isolation: a light user B beside a heavy user A, stock against ours.

Per server and round: B (1 stream) alone, then beside A (32 streams, limit
10 tok/s on ours, none on stock), which starts ``LEAD_S`` before B. Figures:
B's tokens/s and TTFT beside A over the same alone, and A's rate meanwhile;
rounds alternate the servers, and the figures are medians over rounds. A
hog with more streams than the engine has slots must not lock B out either:
that is tested on a real server (``tests/e2e/test_lockout.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.measure import log, median, tokens_between, wait_until_drained
from benchmarks.servers import (
    ISO_A,
    ISO_A_LIMIT,
    ISO_A_STREAMS,
    ISO_B,
    ISO_B_LIMIT,
    ServerPool,
)
from vllm_output_rate.loadtest import LoadResult, LoadSpec, UserLoad, run_load

MAX_TOKENS = 256
LEAD_S = 3.0  # A starts this long before B


def _spec(
    url: str,
    model: str,
    user: str,
    streams: int,
    limit: float | None,
    seconds: float,
    timeout_s: float | None = None,
) -> LoadSpec:
    return LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(user, streams, limit)],
        max_tokens=MAX_TOKENS,
        duration_s=seconds,
        **({"request_timeout_s": timeout_s} if timeout_s else {}),
    )


async def _beside(
    url: str, model: str, seconds: float, limited: bool
) -> tuple[LoadResult, LoadResult]:
    """A's streams start LEAD_S before B, which runs ``seconds``; the
    client cuts A's requests two seconds after B's end, so a throttled A
    does not hold the run."""
    a_spec = _spec(
        url,
        model,
        ISO_A,
        ISO_A_STREAMS,
        ISO_A_LIMIT if limited else None,
        seconds + LEAD_S,
        seconds + LEAD_S + 2.0,
    )
    b_spec = _spec(url, model, ISO_B, 1, ISO_B_LIMIT if limited else None, seconds)

    async def b_later() -> LoadResult:
        await asyncio.sleep(LEAD_S)
        return await run_load(b_spec)

    a, b = await asyncio.gather(run_load(a_spec), b_later())
    return a, b


def _b(result: LoadResult) -> dict[str, Any]:
    u = result.user(ISO_B)
    return {
        "tok_s": u.rate_tok_s,
        "ttft_p50_ms": u.ttft_p50_ms,
        "failed": u.requests_failed,
    }


def _ratio(beside: float | None, alone: float | None) -> float | None:
    return beside / alone if beside is not None and alone else None


def isolation(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """Every round on both servers (module docstring)."""
    rounds, seconds = (1, 8.0) if quick else (3, 12.0)
    pool.start("stock", "ours")
    runs = []
    for i in range(rounds):
        for name in ("stock", "ours") if i % 2 == 0 else ("ours", "stock"):
            url, limited = pool.url(name), name == "ours"
            wait_until_drained(url)
            pool.settle()
            b_limit = ISO_B_LIMIT if limited else None
            alone = _b(
                asyncio.run(
                    run_load(_spec(url, pool.model, ISO_B, 1, b_limit, seconds))
                )
            )
            wait_until_drained(url)
            pool.settle()
            a, b = asyncio.run(_beside(url, pool.model, seconds, limited))
            wait_until_drained(url)
            beside = _b(b)
            row = {
                "round": i,
                "server": name,
                "alone": alone,
                "beside": beside,
                "tok_s_ratio": _ratio(beside["tok_s"], alone["tok_s"]),
                "ttft_ratio": _ratio(beside["ttft_p50_ms"], alone["ttft_p50_ms"]),
                "a_tok_s_while_b": tokens_between(a, ISO_A, LEAD_S, LEAD_S + seconds)
                / seconds,
            }
            runs.append(row)
            ratio = row["tok_s_ratio"]
            log(
                f"isolation round {i + 1}/{rounds} {name}: B beside A / alone "
                + ("-" if ratio is None else f"{ratio:.3f}")
            )
    summary = {
        name: {
            key: median(r[key] for r in runs if r["server"] == name)
            for key in ("tok_s_ratio", "ttft_ratio", "a_tok_s_while_b")
        }
        for name in ("stock", "ours")
    }
    return {
        "rounds": rounds,
        "duration_s": seconds,
        "lead_s": LEAD_S,
        "max_tokens": MAX_TOKENS,
        "a_streams": ISO_A_STREAMS,
        "a_limit": ISO_A_LIMIT,
        "b_limit": ISO_B_LIMIT,
        "runs": runs,
        "summary": summary,
    }
