"""Issue 13's reproduction on a real server: a throttled hog with three times
``--max-num-seqs`` streams must not lock a light user out.

One scenario on one module-scoped server (synchronous scheduling: the
asynchronous path is covered at scheduler level), driven by the official
OpenAI client as a new user would: ``hog`` (5 tok/s) opens
24 streams with a ~300-token prompt; 4 s later ``light`` (the default
100 tok/s) asks for 50 tokens. Before the fix the light user got no token in
60 s (the hog's throttled streams held all 8 resident slots); stock vLLM
answered in about 0.9 s. The hog's rate is judged at the engine, from the
scheduler's dispatch log.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from harness.bounds import S, assert_bound
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV
from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

pytestmark = pytest.mark.e2e

HOG_LIMIT, LIGHT_LIMIT = 5, 100
HOG_STREAMS, HOG_TOKENS = 24, 4  # 96 tokens: about 19 s at 5 tok/s
LIGHT_TOKENS, LIGHT_AFTER_S = 50, 4.0
ARGS = [
    "--max-num-seqs",
    "8",
    "--max-num-active-seqs",
    "4",
    "--default-user-output-tokens-per-second",
    str(LIGHT_LIMIT),
    "--user-output-tokens-per-second",
    json.dumps({"hog": HOG_LIMIT}),
]
PROMPT = " ".join(f"word{i % 50} and" for i in range(100))


@dataclass
class Stream:
    user: str
    start_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None


@dataclass
class Scenario:
    hog: list[Stream]
    light: Stream
    dispatched: dict[str, list[int]]
    metrics: dict[str, float] = field(default_factory=dict)


async def stream(client: AsyncOpenAI, model: str, user: str, max_tokens: int) -> Stream:
    record = Stream(user, time.monotonic())
    response = await client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": user}},
    )
    async for chunk in response:
        for choice in chunk.choices:
            if choice.text and record.first_token_s is None:
                record.first_token_s = time.monotonic()
            if choice.finish_reason:
                record.finish_reason = choice.finish_reason
        if chunk.usage is not None:
            record.tokens = chunk.usage.completion_tokens
            record.prompt_tokens = chunk.usage.prompt_tokens
    record.end_s = time.monotonic()
    return record


async def drive(url: str, model: str) -> tuple[list[Stream], Stream]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    try:
        hogs = [
            asyncio.create_task(stream(client, model, "hog", HOG_TOKENS))
            for _ in range(HOG_STREAMS)
        ]
        await asyncio.sleep(LIGHT_AFTER_S)
        light = await stream(client, model, "light", LIGHT_TOKENS)
        return list(await asyncio.gather(*hogs)), light
    finally:
        await client.close()


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:output_rate_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def scenario(tiny_model_path: str, tmp_path_factory) -> Scenario:
    log = Path(tmp_path_factory.mktemp("lockout")) / "dispatch.csv"
    env = {
        "VLLM_PLUGINS": "output_rate,output_rate_http",
        DISPATCH_LOG_ENV: str(log),
    }
    with running_server(tiny_model_path, ARGS, env=env) as url:
        hog, light = asyncio.run(drive(url, tiny_model_path))
        time.sleep(2.5)  # the API server polls the engine's counters each second
        result = Scenario(hog, light, read_dispatch_log(str(log)), metrics(url))
    return result


def test_the_light_user_is_served_at_once(scenario: Scenario) -> None:
    light = scenario.light
    assert light.prompt_tokens is not None and light.prompt_tokens >= 250
    assert light.first_token_s is not None and light.end_s is not None
    assert light.first_token_s - light.start_s < 3.0, light
    assert light.end_s - light.start_s < 6.0, light
    assert (light.tokens, light.finish_reason) == (LIGHT_TOKENS, "length")


def test_every_hog_stream_completes_unchanged(scenario: Scenario) -> None:
    for hog in scenario.hog:
        assert (hog.tokens, hog.finish_reason) == (HOG_TOKENS, "length"), hog
    # Some of the hog's streams were preempted to make room, and resumed.
    reclaimed = scenario.metrics['vllm:output_rate_reclaimed_total{user="hog"}']
    assert reclaimed >= 1
    assert 'vllm:output_rate_recomputed_tokens_total{user="hog"}' in scenario.metrics


def test_the_hog_gets_its_limit_at_the_engine(scenario: Scenario) -> None:
    times = scenario.dispatched["hog"]
    assert_bound(times, HOG_LIMIT)
    # All but the last second of the log is on disk while the engine runs;
    # the hog had demand the whole time it appears in it.
    span_s = (times[-1] - times[0]) / S
    assert span_s > 10
    assert len(times) - 1 >= 0.95 * HOG_LIMIT * span_s, (len(times), span_s)
    assert len(scenario.dispatched["light"]) == LIGHT_TOKENS
