"""Images are prompt work: a user sending images is charged for them and
paced at its prompt rate, and another user's answers come as if alone.

A real server on the tiny vision model (``demo/tiny_vision.py``: Idefics3,
each image 64 image tokens and 3 around them), the prefix cache off,
``--max-num-batched-tokens 512``. ``hog`` keeps 8 chat requests of 6 images
each going (about 400 prompt tokens of images, one token out), at a prompt
rate of 2,000 tok/s; ``light`` sends 8-token text requests one after
another. What the engine charged each user is read from the admin stats
(``prompt_tokens``) and checked against what vLLM reports it computed
(each answer's ``usage.prompt_tokens``, all but the last token of each).
"""

from __future__ import annotations

import asyncio
import base64
import io
import statistics
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from harness.prefill_load import (
    ENGINE_ARGS,
    hog_prompt_rate_args,
    light_alone_and_beside,
    user,
)
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

KEY = "test-admin-key"
HOG_RATE = 2_000.0  # prompt tokens per second
HOG_STREAMS = 8
IMAGES = 6
IMAGE_TOKENS = 64 + 3  # tiny_vision: image_seq_len and the wrapper tokens
STEP_TOKENS = int(ENGINE_ARGS[ENGINE_ARGS.index("--max-num-batched-tokens") + 1])
ARGS = [
    *ENGINE_ARGS,
    "--no-enable-prefix-caching",
    "--limit-mm-per-prompt",
    f'{{"image": {IMAGES}}}',
    *hog_prompt_rate_args(HOG_RATE),
]
ENV = {
    "VLLM_PLUGINS": "output_rate,output_rate_http",
    "VLLM_OUTPUT_RATE_ADMIN_KEY": KEY,
}
LIGHT_REQUESTS = 20
BURST_S = 0.1
MARGIN_S = 0.05  # two steps of a few tokens, and the front end's noise


def image_url(shade: int) -> str:
    from PIL import Image

    picture = Image.new("RGB", (64, 48), (shade, 90, 200 - shade))
    png = io.BytesIO()
    picture.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


async def hog_loop(
    client: AsyncOpenAI, model: str, stop: asyncio.Event, prompts: list[int]
) -> None:
    images = [
        {"type": "image_url", "image_url": {"url": image_url(20 * i)}}
        for i in range(IMAGES)
    ]
    content: list[Any] = [*images, {"type": "text", "text": "what do they show?"}]
    while not stop.is_set():
        answer = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=1,
            extra_body=user("hog"),
        )
        assert answer.usage is not None
        prompts.append(answer.usage.prompt_tokens)


def charged(url: str, name: str) -> int:
    stats = httpx.get(
        url + "/v1/output_rate/stats",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    return int(stats["users"].get(name, {}).get("prompt_tokens", 0))


def test_images_are_charged_and_paced_at_the_users_prompt_rate() -> None:
    model = str(build_tiny_model(variant="vision"))
    prompts: list[int] = []

    def start_hog(client: AsyncOpenAI, stop: asyncio.Event) -> list[Any]:
        return [
            asyncio.create_task(hog_loop(client, model, stop, prompts))
            for _ in range(HOG_STREAMS)
        ]

    with running_server(model, ARGS, env=ENV) as server:
        alone, beside, elapsed = asyncio.run(
            light_alone_and_beside(str(server), model, start_hog, LIGHT_REQUESTS)
        )
        time.sleep(1.5)  # the stats are the engine's, read through its RPC
        hog_charged = charged(str(server), "hog")
    # Each answer's prompt: its images' tokens and a few of text; all but
    # its last token computed as prompt.
    assert prompts and min(prompts) >= IMAGES * IMAGE_TOKENS, prompts
    computed = sum(tokens - 1 for tokens in prompts)
    alone_s, beside_s = statistics.median(alone), statistics.median(beside)
    print(
        f"hog: {len(prompts)} answers of {prompts[0]} prompt tokens, {computed} "
        f"computed in {elapsed:.1f} s ({computed / elapsed:,.0f} tok/s, rate "
        f"{HOG_RATE:,.0f}), {hog_charged} charged; light latency p50 alone "
        f"{alone_s * 1e3:.0f} ms, beside {beside_s * 1e3:.0f} ms"
    )
    # Charged for its images: every answered prompt, and at most what the
    # streams still had in flight at the end besides.
    assert computed <= hog_charged <= computed + HOG_STREAMS * max(prompts)
    # The bound, widened by a chunk: an image may not be cut, so a chunk
    # holding one is charged after it ran (docs/architecture.md).
    assert computed <= (elapsed + BURST_S) * HOG_RATE + 1 + STEP_TOKENS
    # And the rate in the long run, less what was in flight at the end.
    assert computed >= elapsed * HOG_RATE - HOG_STREAMS * max(prompts)
    assert beside_s <= 2 * alone_s + MARGIN_S, (alone, beside)
