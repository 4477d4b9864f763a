"""Admission on a real server: the issue's reproduction with the official
OpenAI client, the rate-limit headers on each generating route, and the bad
input at the door (n above the cap, an abort while queued, a client that
hammers).

One server: ``--max-num-queued-reqs 16`` (vLLM's own cap, which stock vLLM
lets a throttled user's paused requests fill), the default per-user cap
(the same 16), and ``capped`` with a cap of its own. Rates are small enough
that this CPU is never the bottleneck.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.server_metrics import metric_total, scrape_total
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.loadtest.sse import sse_data

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")

LIMITS = {"hog": 20, "light": 25, "capped": 4, "routes": 100, "fast": 100_000}
ARGS = [
    # Room for streams that outlast any test at full speed (beyond the tiny
    # model's 4,096 positions: random weights, nothing to lose).
    "--max-model-len",
    "20000",
    "--max-num-seqs",
    "32",
    "--max-num-queued-reqs",
    "16",
    "--default-user-output-tokens-per-second",
    "100",
    "--user-output-tokens-per-second",
    json.dumps(LIMITS),
    "--user-max-concurrent-requests",
    '{"capped": 2}',
    "--enable-scale-out",  # serves /inference/v1/generate
]
ADMIN_KEY = "admin-key"
ENV = {
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    "VLLM_PLUGINS": "output_rate,output_rate_http",
    "VLLM_OUTPUT_RATE_ADMIN_KEY": ADMIN_KEY,
}
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # about 100 tokens
RATE_HEADERS = (
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


@pytest.fixture(scope="module")
def server(tiny_model_path: str) -> Iterator[str]:
    with running_server(tiny_model_path, ARGS, env=ENV) as url:
        yield url


def xargs(user: str) -> dict[str, Any]:
    return {"vllm_xargs": {"output_rate_user": user}}


# ----- the reproduction ------------------------------------------------


def test_a_throttled_user_cannot_fill_the_queue_for_others(
    server: str, tiny_model_path: str
) -> None:
    """hog opens 24 streams (ignore_eos, ~100-token prompts); 4 s later light
    asks for 50 tokens. Both use the official client with its default
    retries and no retry code of ours."""
    statuses: list[tuple[str, int, str | None]] = []

    async def record(response: Any) -> None:
        user = json.loads(response.request.content)["vllm_xargs"]["output_rate_user"]
        statuses.append(
            (user, response.status_code, response.headers.get("retry-after-ms"))
        )

    async def stream(client: Any, user: str, tokens: int) -> tuple[int, float, float]:
        """(tokens, first token time, last token time)"""
        times, received = [], 0
        response = await client.completions.create(
            model=tiny_model_path,
            prompt=PROMPT,
            max_tokens=tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **xargs(user)},
        )
        async for chunk in response:
            if chunk.choices:
                times.append(time.monotonic())
            if chunk.usage is not None:
                received = chunk.usage.completion_tokens
        return received, times[0], times[-1]

    async def run() -> tuple[list[Any], Any, float]:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [record]})
        async with openai.AsyncOpenAI(
            base_url=server + "/v1", api_key="none", http_client=http
        ) as client:
            start = time.monotonic()
            hogs = [asyncio.create_task(stream(client, "hog", 10)) for _ in range(24)]
            await asyncio.sleep(4)  # as in the issue
            light = await stream(client, "light", 50)
            results = await asyncio.gather(*hogs, return_exceptions=True)
            return results, light, start

    hogs, light, start = asyncio.run(run())
    # light is admitted at once (no 503, no retry) and served at its limit.
    assert [s for s in statuses if s[0] == "light"] == [("light", 200, None)]
    tokens, first, last = light
    assert tokens == 50
    light_rate = (tokens - 1) / (last - first)
    assert 0.7 * LIMITS["light"] <= light_rate <= 1.3 * LIMITS["light"], light_rate
    # The hog's excess got 429 with Retry-After, never 503.
    hog_codes = [code for user, code, _ in statuses if user == "hog"]
    assert 503 not in hog_codes
    refused = [ms for user, code, ms in statuses if user == "hog" and code == 429]
    assert len(refused) >= 8 and all(ms is not None for ms in refused)
    # Every hog response that was admitted completed; the client's own
    # retries (after Retry-After) got the excess in once slots came back.
    done = [r for r in hogs if not isinstance(r, BaseException)]
    assert all(r[0] == 10 for r in done)
    assert len(done) > 16, hogs  # some retries were admitted
    failed = [r for r in hogs if isinstance(r, BaseException)]
    assert all(isinstance(e, openai.RateLimitError) for e in failed), failed
    # Over time the hog gets its limit, and no more.
    first_hog = min(r[1] for r in done)
    last_hog = max(r[2] for r in done)
    delivered = sum(r[0] for r in done)
    assert delivered <= (last_hog - start + 0.1) * LIMITS["hog"] + 1
    assert delivered / (last_hog - first_hog) >= 0.8 * LIMITS["hog"]


def test_the_clients_own_retry_succeeds_when_the_excess_is_transient(
    server: str, tiny_model_path: str
) -> None:
    """capped (4 tok/s, 2 requests) sends 3 short requests at once: the third
    gets 429 and the official client's retry, after Retry-After, succeeds."""
    codes: list[int] = []

    async def record(response: Any) -> None:
        codes.append(response.status_code)

    async def run() -> list[Any]:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [record]})
        async with openai.AsyncOpenAI(
            base_url=server + "/v1", api_key="none", http_client=http
        ) as client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=tiny_model_path,
                        prompt="hi",
                        max_tokens=3,
                        extra_body={"ignore_eos": True, **xargs("capped")},
                    )
                    for _ in range(3)
                )
            )

    answers = asyncio.run(run())
    assert [a.usage.completion_tokens for a in answers] == [3, 3, 3]
    assert codes.count(429) >= 1 and codes.count(200) == 3


def test_a_server_full_of_users_with_budget_still_answers_503(
    server: str, tiny_model_path: str
) -> None:
    """16 streams of a user far below its limit fill vLLM's cap for real: a
    request of another user gets vLLM's 503 (with its own headers)."""
    body = {
        "model": tiny_model_path,
        "prompt": PROMPT,
        # Far more than a test lasts, even on a fast CI machine: the 16 must
        # still be in flight when the other user asks (they are closed then).
        "max_tokens": 19_000,
        "ignore_eos": True,
        "stream": True,
    }

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            streams = await asyncio.gather(  # at once: none ends before the last
                *(
                    client.send(
                        client.build_request(
                            "POST", "/v1/completions", json={**body, **xargs("fast")}
                        ),
                        stream=True,
                    )
                    for _ in range(16)
                )
            )
            assert all(s.status_code == 200 for s in streams)
            deadline = time.monotonic() + 60
            in_engine = 0.0
            while time.monotonic() < deadline:  # until all 16 are in the engine
                metrics = (await client.get("/metrics")).text
                in_engine = metric_total(
                    metrics, "vllm:num_requests_running"
                ) + metric_total(metrics, "vllm:num_requests_waiting")
                if in_engine >= 16:
                    break
                await asyncio.sleep(0.2)
            assert in_engine >= 16, f"only {in_engine} of 16 streams in the engine"
            other = await client.post(
                "/v1/completions",
                json={**body, "stream": False, "max_tokens": 2, **xargs("routes")},
            )
            # Still all in flight when it asked: the 503 was vLLM's cap at work.
            metrics = (await client.get("/metrics")).text
            assert (
                metric_total(metrics, "vllm:num_requests_running")
                + metric_total(metrics, "vllm:num_requests_waiting")
                >= 16
            ), "the streams ended before the other user asked"
            for held in streams:
                await held.aclose()
            return other

    response = asyncio.run(run())
    assert response.status_code == 503, response.text
    assert response.headers["x-ratelimit-limit-tokens"] == "6000"


# ----- headers on each generating route -----------------------------------------


def generating_requests(model: str) -> list[tuple[str, dict[str, Any]]]:
    user = xargs("routes")
    completion = {"model": model, "prompt": "hi", "max_tokens": 3, **user}
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        **user,
    }
    responses = {"model": model, "input": "hi", "max_output_tokens": 3, **user}
    messages = {"model": model, "messages": chat["messages"], "max_tokens": 3, **user}
    generate = {
        "model": model,
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 3, "extra_args": user["vllm_xargs"]},
    }
    return [
        ("/v1/completions", completion),
        ("/v1/completions", {**completion, "stream": True}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/responses", responses),
        ("/v1/responses", {**responses, "stream": True}),
        ("/inference/v1/generate", generate),
        ("/inference/v1/generate", {**generate, "stream": True}),
        ("/v1/messages", messages),
        ("/v1/messages", {**messages, "stream": True}),
        ("/invocations", completion),
        ("/v1/chat/completions/batch", {**chat, "messages": [chat["messages"]]}),
    ]


@pytest.mark.parametrize("index", range(12))
def test_rate_limit_headers_on_each_generating_route(
    server: str, tiny_model_path: str, index: int
) -> None:
    path, body = generating_requests(tiny_model_path)[index]
    with httpx.stream("POST", server + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        headers = response.headers
        response.read()
    # 100 tok/s is 6,000 a minute; this request may still take 3 of them.
    assert headers["x-ratelimit-limit-tokens"] == "6000"
    assert 5900 <= int(headers["x-ratelimit-remaining-tokens"]) <= 6000
    assert headers["x-ratelimit-reset-tokens"].endswith(("ms", "s"))
    # The default cap on requests in flight is --max-num-queued-reqs.
    assert headers["x-ratelimit-limit-requests"] == "16"
    assert 15 <= int(headers["x-ratelimit-remaining-requests"]) <= 16
    assert "retry-after" not in headers


def test_routes_that_do_not_generate_carry_no_headers(server: str) -> None:
    response = httpx.post(server + "/tokenize", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 200
    assert not any(h.startswith("x-ratelimit") for h in response.headers)


# ----- bad input at the door ------------------------------------------------------


def test_n_counts_n_and_n_above_the_cap_gets_400(
    server: str, tiny_model_path: str
) -> None:
    body = {
        "model": tiny_model_path,
        "prompt": "hi",
        "max_tokens": 2,
        **xargs("capped"),
    }
    too_many = httpx.post(server + "/v1/completions", json={**body, "n": 3}, timeout=60)
    assert too_many.status_code == 400 and "n=3" in too_many.text
    assert "retry-after" not in too_many.headers
    two = httpx.post(server + "/v1/completions", json={**body, "n": 2}, timeout=60)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2


def test_an_abort_while_queued_gives_the_place_back(
    server: str, tiny_model_path: str
) -> None:
    """capped holds its two places with long streams; closing one of them
    (an abort before it finished) lets the next request in."""
    body = {
        "model": tiny_model_path,
        "prompt": "hi",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        **xargs("capped"),
    }
    with httpx.Client(base_url=server, timeout=60) as client:
        first = client.send(
            client.build_request("POST", "/v1/completions", json=body), stream=True
        )
        second = client.send(
            client.build_request("POST", "/v1/completions", json=body), stream=True
        )
        assert first.status_code == second.status_code == 200
        refused = client.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        first.close()  # the client goes away: vLLM aborts the request
        deadline = time.monotonic() + 10
        while True:
            again = client.post(
                "/v1/completions", json={**body, "max_tokens": 1, "stream": False}
            )
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again.status_code == 200, again.text
        second.close()


def test_a_client_that_hammers_is_refused_cheaply_and_slows_nobody(
    server: str, tiny_model_path: str
) -> None:
    hold = {
        "model": tiny_model_path,
        "prompt": "hi",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
        **xargs("capped"),
    }
    light = {
        "model": tiny_model_path,
        "prompt": "hi",
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
        **xargs("light"),
    }

    async def light_rate(client: httpx.AsyncClient) -> float:
        times = []
        async with client.stream("POST", "/v1/completions", json=light) as response:
            assert response.status_code == 200
            async for data in sse_data(response):
                if data.strip() != "[DONE]" and json.loads(data)["choices"]:
                    times.append(time.monotonic())
        return (len(times) - 1) / (times[-1] - times[0])

    async def hammer(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
        latencies = []
        while not stop.is_set():
            sent = time.monotonic()
            response = await client.post(
                "/v1/completions", json={**hold, "stream": False}
            )
            assert response.status_code == 429
            latencies.append(time.monotonic() - sent)
        return latencies

    async def run() -> tuple[float, list[float]]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            holders = [
                await client.send(
                    client.build_request("POST", "/v1/completions", json=hold),
                    stream=True,
                )
                for _ in range(2)
            ]
            stop = asyncio.Event()
            hammering = asyncio.create_task(hammer(client, stop))
            rate = await light_rate(client)
            stop.set()
            latencies = await hammering
            for held in holders:
                await held.aclose()
            return rate, latencies

    engine_before = scrape_total(server, "vllm:request_success_total")
    rate, latencies = asyncio.run(run())
    assert len(latencies) >= 20
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.25, latencies  # median
    assert rate >= 0.8 * LIMITS["light"], rate
    # None of the refused requests reached the engine.
    finished = scrape_total(server, "vllm:request_success_total") - engine_before
    assert finished <= 1  # light's own request (the holders were aborted)
    assert scrape_total(server, "vllm:output_rate_admission_rejections_total") >= len(
        latencies
    )
