"""A prefill hog and a light user, through the official OpenAI client: the
load of issue 38's reproduction, shared by its end-to-end test and its
benchmark (``benchmarks/prefill.py``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI

# The engine of the reproduction: 512 tokens a step, resident slots plenty.
ENGINE_ARGS = (
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "64",
    "--max-num-batched-tokens",
    "512",
)


# Output and prompt rates far above demand, but the hog's prompt rate.
def hog_prompt_rate_args(rate: float) -> list[str]:
    return [
        "--default-user-output-tokens-per-second",
        "100000",
        "--default-user-prompt-tokens-per-second",
        "1000000",
        "--user-prompt-tokens-per-second",
        f'{{"hog": {rate}}}',
    ]


HOG_STREAMS = 16
HOG_WORDS = 300  # about 1,400 prompt tokens on the tiny model
# Random words, so that the prefix cache cannot help the hog.
WORDS = [f"w{i}" for i in range(5000)]


def user(name: str) -> dict[str, Any]:
    return {"vllm_xargs": {"output_rate_user": name}}


async def hog_loop(
    client: AsyncOpenAI,
    model: str,
    stop: asyncio.Event,
    prompt_tokens: list[int] | None = None,
) -> int:
    """One of the hog's streams: long distinct prompts, one token out each,
    until ``stop``; returns how many were answered (``prompt_tokens``: each
    answer's prompt tokens are appended there)."""
    answered = 0
    rng = random.Random()
    while not stop.is_set():
        prompt = " ".join(rng.choice(WORDS) for _ in range(HOG_WORDS))
        answer = await client.completions.create(
            model=model, prompt=prompt, max_tokens=1, extra_body=user("hog")
        )
        answered += 1
        if prompt_tokens is not None and answer.usage is not None:
            prompt_tokens.append(answer.usage.prompt_tokens)
    return answered


async def light_requests(
    client: AsyncOpenAI, model: str, count: int
) -> tuple[list[float], list[float]]:
    """``count`` short streamed requests (8 tokens out) one after another:
    each one's time to first token and latency, in seconds."""
    ttfts, latencies = [], []
    for _ in range(count):
        started = time.monotonic()
        first = None
        stream = await client.completions.create(
            model=model,
            prompt="hello there",
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True, **user("light")},
        )
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.monotonic() - started
        ttfts.append(first if first is not None else float("nan"))
        latencies.append(time.monotonic() - started)
    return ttfts, latencies


def start_hog(
    client: AsyncOpenAI,
    model: str,
    stop: asyncio.Event,
    prompt_tokens: list[int] | None = None,
) -> list[asyncio.Task[int]]:
    return [
        asyncio.create_task(hog_loop(client, model, stop, prompt_tokens))
        for _ in range(HOG_STREAMS)
    ]


# Starts a load's tasks on a client, until the event is set.
StartLoad = Callable[[AsyncOpenAI, asyncio.Event], list["asyncio.Task[Any]"]]


async def light_alone_and_beside(
    url: str, model: str, start_load: StartLoad, count: int, settle_s: float = 3.0
) -> tuple[list[float], list[float], float]:
    """The light user's ``count`` latencies alone (after a warm-up), then
    beside the load ``start_load`` starts (from ``settle_s`` in, so that the
    load's requests wait where they will); and the load's seconds from its
    start to its last answer."""
    client = AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    await light_requests(client, model, 5)  # warm-up
    _, alone = await light_requests(client, model, count)
    stop = asyncio.Event()
    started = time.monotonic()
    tasks = start_load(client, stop)
    await asyncio.sleep(settle_s)
    _, beside = await light_requests(client, model, count)
    stop.set()
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    await client.close()
    return alone, beside, elapsed
