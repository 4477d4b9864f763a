"""Admission at the door: what the check costs and what it changes, against
stock vLLM (``make bench``'s ``admission`` section; alone:
``PYTHONPATH=tests:. python -m benchmarks.admission [--quick] [--json FILE]``).

1. **The check's cost per request**, in process: vLLM's own
   ``AsyncLLM.check_admission`` (run on vLLM's real ``OutputProcessor``)
   against ours (the user's caps, vLLM's caps with paused users left out,
   the door reservation and its release), and the headers of a response,
   with N requests of 100 users in flight; no cap binds.
2. **Server throughput with caps not binding**: stock vLLM against ours
   (limits far above demand, per-user caps and ``--max-num-queued-reqs``
   set but never reached) and ours without the HTTP part (no admission),
   each once a round in a rotated order; the bar is ours / stock >= 0.98.
3. **The issue's reproduction**: ``--max-num-seqs 32 --max-num-queued-reqs
   16``; hog opens 24 streams of 60 tokens (about 100 prompt tokens,
   ignore_eos; 5 tok/s on ours), light asks for 50 tokens 4 s later (100
   tok/s on ours): light's answer, time to its first and last token; the
   hog's answers. One request each, no retries.

The servers run side by side and only one is loaded at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model
from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync
from vllm_output_rate.loadtest.sse import sse_data

COMMON_ARGS = ["--max-num-seqs", "32", "--max-num-queued-reqs", "16"]
OURS_ARGS = [
    "--default-user-output-tokens-per-second",
    "1000000",
    "--user-output-tokens-per-second",
    json.dumps({"hog": 5, "light": 100}),
    "--default-user-max-concurrent-requests",
    "16",
]
OURS_ENV = {"VLLM_PLUGINS": "output_rate,output_rate_http"}
STOCK_ENV = {"VLLM_PLUGINS": ""}
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # about 100 tokens
BAR = 0.98


# ----- 1. the check's cost, in process -----------------------------------------


def _fake_states(count: int) -> dict[str, Any]:
    return {
        f"r{i}": SimpleNamespace(prompt_len=100, is_prefilling=i % 4 == 0)
        for i in range(count)
    }


def check_cost(in_flight: int, calls: int) -> dict[str, float]:
    """Microseconds per call: vLLM's check, ours at the door (with its
    release), and ours plus the response's headers."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_output_rate.integration import admission as adm
    from vllm_output_rate.integration import admission_context as ctx
    from vllm_output_rate.integration.admission_view import EngineViews

    processor = OutputProcessor(None, log_stats=False)
    processor.request_states.update(_fake_states(in_flight))
    client = SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_queued_reqs=10**6, max_num_queued_tokens=10**9
        ),
        admission_stats=None,
        output_processor=processor,
        logger_manager=None,
        get_num_unfinished_requests=processor.get_num_unfinished_requests,
        get_num_queued_tokens=processor.get_num_queued_tokens,
    )
    client._record_admission_rejection = lambda reason: None

    def stock() -> None:
        AsyncLLM.check_admission(client, 1)  # type: ignore[arg-type]

    async def answer(payload: dict[str, Any]) -> list[Any]:
        users = {u: [100.0, 100.0, 0.0, 1, 50, 10, u, 0] for u in payload["users"]}
        return [
            {
                "users": users,
                "caps_version": 1,
                "caps": {"default_user_max_concurrent_requests": 10**5},
                "global_caps": [10**6, 10**9],
            }
        ]

    views = EngineViews(answer)
    checker = adm.Admission(client, views)
    views.local_users = checker.ledger.users
    for i in range(in_flight):  # 100 users share the requests in flight
        checker.ledger.register(f"user-{i % 100}", f"r{i}", 1)
    asyncio.run(views.refresh())
    request = SimpleNamespace(
        vllm_xargs={"output_rate_user": "user-7"}, n=1, max_tokens=50
    )

    def ours() -> ctx.AdmissionContext:
        context = ctx.AdmissionContext()
        token = ctx.current.set(context)
        ctx.note_checked_request(request)
        checker.check_admission(1)
        ctx.current.reset(token)
        checker.end(context)
        return context

    async def ours_with_headers() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            await checker.headers(ours())
        return time.perf_counter() - start

    return {
        "in_flight": in_flight,
        "stock_us": _per_call_us(stock, calls),
        "ours_us": _per_call_us(ours, calls),
        "ours_with_headers_us": 1e6 * asyncio.run(ours_with_headers()) / calls,
    }


def _per_call_us(function: Callable[[], Any], calls: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / calls


# ----- servers ---------------------------------------------------------------------


def start_servers(stack: ExitStack, model: str) -> dict[str, str]:
    """The servers, started in parallel; each engine on the same core (only
    one is loaded at a time, and an idle engine waits without spinning)."""
    configs = {
        "stock": (COMMON_ARGS, STOCK_ENV),
        "ours": (COMMON_ARGS + OURS_ARGS, OURS_ENV),
        # Limits without the HTTP part: no admission (and so no global cap,
        # which it would refuse), to tell admission's cost from the rest.
        "ours_without_admission": (
            ["--max-num-seqs", "32", *OURS_ARGS[:4]],
            {"VLLM_PLUGINS": "output_rate"},
        ),
    }
    urls: dict[str, str] = {}
    errors: list[BaseException] = []
    ready = threading.Barrier(len(configs) + 1)
    done = threading.Event()

    def run(name: str, args: list[str], env: dict[str, str]) -> None:
        try:
            with running_server(model, args, env=env, start_timeout_s=900) as url:
                urls[name] = url
                ready.wait()
                done.wait()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            ready.abort()

    threads = [
        threading.Thread(target=run, args=(name, *config), daemon=True)
        for name, config in configs.items()
    ]
    for thread in threads:
        thread.start()

    def stop() -> None:
        done.set()
        for thread in threads:
            thread.join(timeout=120)

    stack.callback(stop)
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError(f"a server did not start: {errors}") from None
    return urls


# ----- 2. throughput with caps not binding ----------------------------------------


def throughput(url: str, model: str, seconds: float) -> float:
    """Output tokens per second of 4 users x 2 streams of 64-token requests."""
    spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(f"tp-{i}", 2) for i in range(4)],
        max_tokens=64,
        duration_s=seconds,
    )
    result = run_load_sync(spec)
    if not result.ok:
        raise RuntimeError(f"{url}: {result.error_summary()}")
    return result.total_tokens / result.elapsed_s


def rounds_of(
    urls: dict[str, str], model: str, rounds: int, seconds: float
) -> dict[str, Any]:
    """Each server once per round, the order rotated every round; each
    server's rate against stock's in the same round."""
    names = list(urls)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(throughput(urls[name], model, seconds))
    figures: dict[str, Any] = {"rates_tok_s": rates, "bar": BAR}
    for name in names[1:]:
        ratios = [o / s for o, s in zip(rates[name], rates["stock"], strict=True)]
        figures[f"{name}_over_stock"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    admission = [
        o / p
        for o, p in zip(rates["ours"], rates["ours_without_admission"], strict=True)
    ]
    figures["ours_over_ours_without_admission"] = statistics.median(admission)
    figures["bar_met"] = figures["ours_over_stock"]["median"] >= BAR
    return figures


# ----- 3. the reproduction ------------------------------------------------


async def _stream(
    client: httpx.AsyncClient, model: str, user: str, tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"output_rate_user": user},
    }
    sent = time.monotonic()
    first = last = None
    error = False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        status = response.status_code
        retry = response.headers.get("retry-after-ms")
        if status == 200:
            async for data in sse_data(response):
                if data.startswith('{"error"'):
                    error = True  # refused inside its 200 stream
                elif data.startswith("{"):
                    last = time.monotonic()
                    first = first or last
        else:
            await response.aread()
    return {
        "status": "200 with an error event" if error else status,
        "retry_after_ms": None if retry is None else int(retry),
        "first_token_s": None if first is None else first - sent,
        "last_token_s": None if last is None else last - sent,
    }


async def reproduction(url: str, model: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        hogs = [
            asyncio.create_task(_stream(client, model, "hog", 60)) for _ in range(24)
        ]
        await asyncio.sleep(4)
        light = await _stream(client, model, "light", 50)
        # The hog's admitted streams take minutes at 5 tok/s on ours: the
        # figures are its answers, so its streams are closed (aborted) here.
        await asyncio.sleep(1)
        finished = [h.result() for h in hogs if h.done()]
        for hog in hogs:
            hog.cancel()
    statuses: dict[str, int] = {}
    for answer in finished:
        statuses[str(answer["status"])] = statuses.get(str(answer["status"]), 0) + 1
    return {
        "light": light,
        "hog_answers_by_status": statuses,
        "hog_still_streaming": 24 - len(finished),
    }


# ----- the run ---------------------------------------------------------------------


def run(quick: bool, work_dir: Path | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"quick": quick}
    calls = 2_000 if quick else 20_000
    figures["check_cost"] = [check_cost(n, calls) for n in (0, 1_000)]
    print_section("check cost per request (us)", figures["check_cost"])
    model = str(build_tiny_model())
    with ExitStack() as stack:
        urls = start_servers(stack, model)
        rounds, seconds = (3, 6.0) if quick else (6, 15.0)
        for url in urls.values():
            throughput(url, model, 2.0)  # warm up
        figures["throughput"] = rounds_of(urls, model, rounds, seconds)
        print_section("throughput, caps not binding", figures["throughput"])
        figures["reproduction"] = {
            name: asyncio.run(reproduction(urls[name], model))
            for name in ("stock", "ours")
        }
        print_section("the issue's reproduction", figures["reproduction"])
    return figures


def print_section(title: str, value: Any) -> None:
    print(f"\n== {title}")
    print(json.dumps(value, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.admission")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
