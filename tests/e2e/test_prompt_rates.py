"""Prompt-token rates on a real server: a user's long prompts are computed
at its prompt rate, and another user's answers come as if it were alone.

One server: ``--max-num-seqs 64 --max-num-batched-tokens 512``, the prefix
cache off (each prompt computed whole), output limits far above demand,
prompt rates far above demand except the hog's, 3,000 prompt tokens a
second. ``hog`` keeps 16 requests of ~1,400-token prompts going (one token
out each); ``light`` sends 8-token streamed requests one after another
through the official OpenAI client. Without a prompt rate every step
carries ~500 of the hog's tokens and the light user's answers take several
times as long as alone (BENCHMARKS.md, "prefill"); with it the hog's
prompts are a small part of the steps.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest

from harness.prefill_load import (
    ENGINE_ARGS,
    hog_prompt_rate_args,
    light_alone_and_beside,
    start_hog,
)
from vllm_output_rate.demo.server import running_server

pytestmark = pytest.mark.e2e

HOG_RATE = 3_000.0  # prompt tokens per second
ARGS = [*ENGINE_ARGS, "--no-enable-prefix-caching", *hog_prompt_rate_args(HOG_RATE)]
LIGHT_REQUESTS = 20
BURST_S = 0.1
# Two steps of a few tokens each, and the HTTP front end's noise.
MARGIN_S = 0.05


def test_long_prompts_go_at_their_users_prompt_rate(tiny_model_path: str) -> None:
    with running_server(tiny_model_path, ARGS) as server:
        prompts: list[int] = []
        alone, beside, elapsed = asyncio.run(
            light_alone_and_beside(
                str(server),
                tiny_model_path,
                lambda client, stop: start_hog(client, tiny_model_path, stop, prompts),
                LIGHT_REQUESTS,
            )
        )
    # Every answered prompt was computed in the window, all but its last
    # token as prompt (that one is computed with the first output token).
    computed = sum(tokens - 1 for tokens in prompts)
    alone_s, beside_s = statistics.median(alone), statistics.median(beside)
    print(
        f"hog: {computed} prompt tokens in {elapsed:.1f} s "
        f"({computed / elapsed:,.0f} tok/s, rate {HOG_RATE:,.0f}); light latency "
        f"p50 alone {alone_s * 1e3:.0f} ms, beside {beside_s * 1e3:.0f} ms"
    )
    # The bound: at most (W + burst) x rate + 1 prompt tokens in W seconds.
    assert computed <= (elapsed + BURST_S) * HOG_RATE + 1
    # And the rate in the long run: its 16 streams always have prompts ready;
    # what is still being computed at the end is at most 16 prompts.
    assert computed >= elapsed * HOG_RATE - 16 * 700
    assert beside_s <= 2 * alone_s + MARGIN_S, (alone, beside)
