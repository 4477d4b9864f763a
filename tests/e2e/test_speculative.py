"""Speculative decoding on a real vLLM server with the plugin.

n-gram speculation needs no draft model, but a random-weight model proposes
nothing that it then accepts; the tiny "echo" model predicts the token it was
given, so its continuations repeat and n-gram drafts are accepted (all of
them greedily, most at temperature 1). One server for the module.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model
from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync

pytestmark = pytest.mark.e2e

LIMITS = {"slow": 30, "free": 100_000}
SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
ARGS = [
    "--speculative-config",
    json.dumps(SPECULATION),
    "--default-user-output-tokens-per-second",
    "50",
    "--user-output-tokens-per-second",
    json.dumps(LIMITS),
    "--max-num-seqs",
    "16",
]
PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


@pytest.fixture(scope="module")
def echo_model() -> str:
    return str(build_tiny_model(variant="echo"))


@pytest.fixture(scope="module")
def server(echo_model: str):
    env = {"VLLM_PLUGINS": "output_rate,output_rate_http"}
    with running_server(echo_model, ARGS, env=env) as url:
        assert "OutputRateScheduler" in url.log_text()
        yield url


def metric_sums(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters and our admitted tokens per user."""
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not match:
            continue
        name, labels, value = match.groups()
        if name == "vllm:output_rate_tokens_admitted_total":
            name += labels or ""
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def load(url: str, model: str, users: list[UserLoad], **kwargs):
    spec = LoadSpec(base_url=url, model=model, users=users, prompt=PROMPT, **kwargs)
    result = run_load_sync(spec)
    assert result.ok, result.error_summary()
    for record in result.records:  # paused, never cut
        assert record.finish_reason == "length"
        assert record.tokens == spec.max_tokens == record.usage_completion_tokens
    return result


def test_speculation_keeps_a_throttled_user_at_its_limit(server, echo_model) -> None:
    before = metric_sums(server)
    result = load(
        server,
        echo_model,
        [UserLoad("slow", 2, LIMITS["slow"]), UserLoad("free", 1, None)],
        max_tokens=60,
        duration_s=8,
        extra_body={"temperature": 1.0, "seed": 7},
    )
    slow = result.user("slow")
    assert slow.bound_ok, slow
    assert slow.rate_tok_s >= 0.85 * LIMITS["slow"], slow
    assert result.user("free").rate_tok_s > 3 * LIMITS["slow"]
    # A step's tokens are counted at the next refund point: one more request
    # (another user) runs it; the API server polls the engine once a second.
    load(server, echo_model, [UserLoad("free", 1)], max_tokens=5, duration_s=0.1)
    time.sleep(2.5)
    after = metric_sums(server)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0
    )
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before.get(
        "vllm:spec_decode_num_draft_tokens_total", 0
    )
    # Drafts were proposed and verified, some rejected. How many are accepted
    # at temperature 1 varies from 0.2 % to 24 % between server instances on
    # vLLM's CPU build, stock alike (BENCHMARKS.md section 8), so none is a
    # possible outcome here; acceptance is checked greedily elsewhere.
    assert drafted > 0 and 0 <= accepted < drafted, (accepted, drafted)
    # Net charges equal the tokens received: rejected drafts were given back.
    admitted = 'vllm:output_rate_tokens_admitted_total{user="slow"}'
    assert after[admitted] - before.get(admitted, 0) == slow.tokens_client


def test_a_user_below_its_limit_keeps_its_drafts(server, echo_model) -> None:
    before = metric_sums(server)
    load(
        server,
        echo_model,
        [UserLoad("free", 2, None)],
        max_tokens=100,
        duration_s=3,
        extra_body={"temperature": 0.0},
    )
    after = metric_sums(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0)

    # Greedy, the echo model accepts what n-gram proposes: limits that do not
    # bind must not trim or refuse drafts.
    acceptance = delta("vllm:spec_decode_num_accepted_tokens_total") / delta(
        "vllm:spec_decode_num_draft_tokens_total"
    )
    assert acceptance >= 0.9
