"""3. Idle engine while throttled: CPU time of the engine-core process
while only throttled requests are in flight, against the same plugin with its
idle wait switched off (vLLM's own 1 ms loop, reproduced by a benchmark-only
hook) and against stock vLLM decoding the same streams. Presented by
``benchmarks.report.idle``."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from benchmarks.measure import (
    cpu_seconds,
    delta,
    server_processes,
    wait_until_drained,
)
from benchmarks.progress import log
from benchmarks.servers import (
    IDLE_STREAMS,
    IDLE_USER,
    ServerPool,
)
from vllm_output_rate.demo.server import RunningServer
from vllm_output_rate.loadtest import LoadSpec, UserLoad
from vllm_output_rate.loadtest.client import count_chunk_tokens
from vllm_output_rate.loadtest.spec import build_request_body
from vllm_output_rate.loadtest.sse import sse_data

IDLE_TARGET_PCT = 5.0
IDLE_WARMUP_S = 3.0
IDLE_MAX_TOKENS_THROTTLED = 512
IDLE_MAX_TOKENS_BUSY = 256


async def _stream_forever(
    client: httpx.AsyncClient, body: dict[str, Any], arrivals: list[float]
) -> None:
    """Send ``body`` again and again, appending each token's arrival time,
    until cancelled (cancelling closes the connection: vLLM aborts)."""
    while True:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
            async for data in sse_data(response):
                if data.strip() == "[DONE]":
                    break
                payload = json.loads(data)
                for choice in payload.get("choices") or []:
                    n = count_chunk_tokens(choice, "completions")
                    arrivals.extend([time.monotonic()] * n)


async def _cpu_with_streams(
    url: RunningServer,
    model: str,
    user: str | None,
    streams: int,
    max_tokens: int,
    warmup_s: float,
    window_s: float,
) -> dict[str, Any]:
    procs = server_processes(url)
    arrivals: list[float] = []
    tasks: list[asyncio.Task] = []
    spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(user, max(1, streams))],
        max_tokens=max_tokens,
        duration_s=window_s,
    )
    body = build_request_body(spec, spec.users[0])
    timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=timeout, limits=limits
    ) as client:
        tasks = [
            asyncio.create_task(_stream_forever(client, body, arrivals))
            for _ in range(streams)
        ]
        try:
            await asyncio.sleep(warmup_s)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise RuntimeError(f"stream failed: {task.exception()}")
            before = cpu_seconds(procs)
            t0 = time.monotonic()
            await asyncio.sleep(window_s)
            after = cpu_seconds(procs)
            t1 = time.monotonic()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    tokens = sum(1 for t in arrivals if t0 <= t <= t1)
    return _window(delta(after, before), t1 - t0, tokens)


def _window(cpu: dict[str, float], elapsed: float, tokens: int) -> dict[str, Any]:
    """One measured window: CPU seconds per process role, as % of a core."""
    return {
        "window_s": elapsed,
        "cpu_s": cpu,
        "cpu_pct": {k: 100 * v / elapsed for k, v in cpu.items()},
        "tokens_in_window": tokens,
    }


def idle(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """CPU of the engine-core process (and, for context, the model worker and
    the API server) over a window while:

    * ``ours``: only throttled requests are in flight (user limited to 1
      tok/s, 8 streams, max_tokens far beyond what the window allows): the
      plugin's idle wait is on. Target: engine core below 5 % of one core.
    * ``ours-nowait``: the same, with the idle wait replaced by a no-op (a
      benchmark-only hook): what vLLM's own loop (schedule, an empty model
      step, then sleep 1 ms, while requests exist) costs with everything
      throttled.
    * ``stock busy``: stock vLLM decoding the same 8 streams unthrottled
      (requests re-sent as they finish): the engine working, for scale.
    * ``stock empty``: stock vLLM with no request at all (engine blocked on
      its input queue): the floor.
    """
    window = 5.0 if quick else 10.0
    model = pool.model
    pool.start("stock", "ours", "ours-nowait")
    cases = [
        (
            "ours",
            "ours",
            IDLE_USER,
            IDLE_STREAMS,
            IDLE_MAX_TOKENS_THROTTLED,
            "with limits, only throttled requests (user at 1 tok/s, 8 streams); "
            "idle wait on",
        ),
        (
            "ours-nowait",
            "ours-nowait",
            IDLE_USER,
            IDLE_STREAMS,
            IDLE_MAX_TOKENS_THROTTLED,
            "same, idle wait switched off: vLLM's 1 ms loop",
        ),
        (
            "stock busy",
            "stock",
            IDLE_USER,
            IDLE_STREAMS,
            IDLE_MAX_TOKENS_BUSY,
            "stock vLLM decoding the same 8 streams (no limits)",
        ),
        ("stock empty", "stock", None, 0, 0, "stock vLLM with no request in flight"),
    ]
    rows = []
    for key, server, user, streams, max_tokens, description in cases:
        url = pool.url(server)
        wait_until_drained(url)
        pool.settle()
        if streams:
            data = asyncio.run(
                _cpu_with_streams(
                    url, model, user, streams, max_tokens, IDLE_WARMUP_S, window
                )
            )
            drained = wait_until_drained(url)
        else:
            procs = server_processes(url)
            before = cpu_seconds(procs)
            t0 = time.monotonic()
            time.sleep(window)
            cpu = delta(cpu_seconds(procs), before)
            data = _window(cpu, time.monotonic() - t0, 0)
            drained = True
        rows.append(
            {
                "case": key,
                "server": server,
                "description": description,
                "streams": streams,
                "drained_after": drained,
                **data,
            }
        )
        pct = data["cpu_pct"]
        log(
            f"idle {key}: engine core {pct.get('engine_core', 0):.1f} %, worker "
            f"{pct.get('worker', 0):.1f} %, {data['tokens_in_window']} tokens"
        )
    ours = next(r for r in rows if r["case"] == "ours")
    engine_pct = ours["cpu_pct"]["engine_core"]
    return {
        "quick": quick,
        "window_s": window,
        "warmup_s": IDLE_WARMUP_S,
        "rows": rows,
        "target_pct": IDLE_TARGET_PCT,
        "ours_engine_core_pct": engine_pct,
        "met": engine_pct < IDLE_TARGET_PCT,
    }
