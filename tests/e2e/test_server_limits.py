"""A real vLLM OpenAI server with the plugin, real streaming clients over HTTP.

One server per configuration (module-scoped). Limits are small enough that
the CPU is never the bottleneck, so measured rates reflect the limiter. Rates
are measured per user from first to last token, client side; the margins
allow for HTTP buffering but would fail by a wide factor without limiting.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from harness.server_metrics import scrape_total
from vllm_output_rate import cli
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.loadtest import (
    LoadResult,
    LoadSpec,
    UserLoad,
    run_load_sync,
)
from vllm_output_rate.loadtest.sse import sse_data

pytestmark = pytest.mark.e2e

LIMITS = {"user-a": 20, "user-b": 60, "slow": 25, "fast": 5000}
DEFAULT_LIMIT = 30
# A team over two users, each at the default limit: 40 tok/s together.
CREW_LIMIT = 40
CREW = {
    "crew": {"output_tokens_per_second": CREW_LIMIT, "members": ["crew-1", "crew-2"]}
}
LIMIT_ARGS = [
    "--default-user-output-tokens-per-second",
    str(DEFAULT_LIMIT),
    "--user-output-tokens-per-second",
    json.dumps(LIMITS),
    "--output-rate-teams",
    json.dumps(CREW),
    "--max-num-seqs",
    "32",
    "--max-num-active-seqs",
    "16",
    # Small steps, so a 600-token prompt is prefilled in several chunks.
    "--max-num-batched-tokens",
    "128",
    "--max-model-len",
    "1024",
]


@pytest.fixture(scope="module", params=["sync", "async"])
def limited_server(request: pytest.FixtureRequest, tiny_model_path: str):
    env = (
        {"VLLM_OUTPUT_RATE_CPU_ASYNC_SCHEDULING": "1"}
        if request.param == "async"
        else {}
    )
    with running_server(tiny_model_path, LIMIT_ARGS, env=env) as url:
        expected = (
            "OutputRateAsyncScheduler"
            if request.param == "async"
            else "OutputRateScheduler"
        )
        assert expected in url.log_text()
        yield url


@pytest.fixture(scope="module")
def model_name(tiny_model_path: str) -> str:
    return tiny_model_path


def load(url: str, model: str, users: list[UserLoad], **kwargs) -> LoadResult:
    spec = LoadSpec(base_url=url, model=model, users=users, **kwargs)
    result = run_load_sync(spec)
    assert result.ok, result.error_summary()
    for record in result.records:
        assert record.tokens == record.usage_completion_tokens
        assert record.finish_reason == "length"
        assert record.tokens == spec.max_tokens
    return result


def assert_limited(result: LoadResult, user: str | None, limit: float) -> None:
    summary = result.user(user)
    assert summary.tokens_client == summary.tokens_server
    # (W + 0.1) * limit + 1, W from the first request sent to the last token.
    assert summary.bound_ok, (user, summary)
    assert summary.rate_tok_s >= 0.85 * limit, (user, summary)


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_each_user_gets_its_limit_and_no_more(limited_server, model_name) -> None:
    result = load(
        limited_server,
        model_name,
        [
            UserLoad("user-a", 3, 20),
            UserLoad("user-b", 2, 60),
            UserLoad(None, 2, DEFAULT_LIMIT),
        ],
        max_tokens=40,
        duration_s=6,
    )
    assert_limited(result, "user-a", 20)
    assert_limited(result, "user-b", 60)  # not slowed down by user-a
    # Requests without a user share one anonymous budget.
    assert_limited(result, None, DEFAULT_LIMIT)


def test_a_teams_members_share_its_limit(limited_server, model_name) -> None:
    result = load(
        limited_server,
        model_name,
        [UserLoad("crew-1", 2, DEFAULT_LIMIT), UserLoad("crew-2", 2, DEFAULT_LIMIT)],
        max_tokens=40,
        duration_s=6,
    )
    members = [result.user(u) for u in ("crew-1", "crew-2")]
    records = [r for r in result.records if r.user in ("crew-1", "crew-2")]
    first_sent = min(r.start_s for r in records)
    last_token = max(t for r in records for t, _ in r.chunks)
    window = last_token - first_sent
    tokens = sum(m.tokens_client for m in members)
    # (W + 0.1) x team limit + 1 for both together, W from the first request
    # sent to the last token; each member well under its own 30 tok/s.
    assert tokens <= (window + 0.1) * CREW_LIMIT + 1, (window, members)
    assert tokens / window >= 0.85 * CREW_LIMIT, (window, members)
    for member in members:
        assert member.bound_ok, member
        assert member.rate_tok_s == pytest.approx(CREW_LIMIT / 2, rel=0.3), members


def test_a_fast_user_runs_at_full_speed_beside_throttled_ones(
    limited_server, model_name
) -> None:
    alone = load(
        limited_server,
        model_name,
        [UserLoad("fast", 1, 5000)],
        max_tokens=50,
        duration_s=2,
    )
    beside = load(
        limited_server,
        model_name,
        [UserLoad("slow", 4, 25), UserLoad("fast", 1, 5000)],
        max_tokens=50,
        duration_s=4,
    )
    assert_limited(beside, "slow", 25)
    # Measured side by side on the same server, so CPU noise mostly cancels:
    # throttled neighbours leave the fast user most of its solo speed.
    ratio = beside.user("fast").rate_tok_s / alone.user("fast").rate_tok_s
    assert ratio >= 0.5, (alone.user("fast"), beside.user("fast"))


def test_long_prompts_prefix_hits_short_answers_and_eos(
    limited_server, model_name
) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(200))
    for max_tokens in (1, 3, 30):  # the same long prompt: prefix-cache hits
        response = post(
            limited_server,
            {
                "model": model_name,
                "prompt": long_prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "vllm_xargs": {"output_rate_user": "user-a"},
            },
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == max_tokens
        assert body["usage"]["prompt_tokens"] > 500  # 5+ chunks of 128
        assert body["choices"][0]["finish_reason"] == "length"
    # An answer that ends at EOS: bias EOS (id 1) after 5 tokens.
    response = post(
        limited_server,
        {
            "model": model_name,
            "prompt": "hello",
            "max_tokens": 50,
            "min_tokens": 5,
            "logit_bias": {"1": 100},
            "vllm_xargs": {"output_rate_user": "user-a"},
        },
    )
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] == 6


def test_refusals_get_http_400_and_the_server_keeps_serving(
    limited_server, model_name
) -> None:
    base = {"model": model_name, "prompt": "hi", "max_tokens": 2}
    for xargs in (
        {"output_rate_user": 5},
        {"output_rate_user": ""},
        {"output_rate_user": "x" * 300},
    ):
        response = post(limited_server, {**base, "vllm_xargs": xargs})
        assert response.status_code == 400, response.text
        assert "output_rate_user" in response.json()["error"]["message"]
    streamed = post(
        limited_server,
        {
            "model": model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "vllm_xargs": {"output_rate_user": ["a"]},
        },
        path="/v1/chat/completions",
    )
    assert streamed.status_code == 400  # before the stream starts
    beam = post(limited_server, {**base, "use_beam_search": True, "n": 2})
    assert beam.status_code == 400 and "beam search" in beam.text
    ok = post(limited_server, {**base, "vllm_xargs": {"output_rate_user": "user-b"}})
    assert ok.status_code == 200


def test_a_client_leaving_while_throttled_frees_its_request(
    limited_server, model_name
) -> None:
    async def scenario() -> tuple[float, int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "model": model_name,
                "prompt": "hello",
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
                "vllm_xargs": {"output_rate_user": "slow"},
            }
            async with client.stream(
                "POST", limited_server + "/v1/completions", json=body
            ) as response:
                assert response.status_code == 200
                received = 0
                async for data in sse_data(response):
                    if data.startswith("{"):
                        received += 1
                        if received == 2:
                            break  # leave while user "slow" is throttled
                # The gauge that shows it gone shows it there first.
                assert scrape_total(limited_server, "vllm:num_requests_running") >= 1
            left_at = time.monotonic()
            while scrape_total(limited_server, "vllm:num_requests_running") > 0:
                assert time.monotonic() - left_at < 10, "request not aborted"
                await asyncio.sleep(0.2)
            return time.monotonic() - left_at, received

    elapsed, received = asyncio.run(scenario())
    assert received == 2
    assert elapsed < 10
    assert scrape_total(limited_server, "vllm:kv_cache_usage_perc") == 0
    # The server goes on serving others.
    after = load(
        limited_server,
        model_name,
        [UserLoad("user-b", 1, 60)],
        max_tokens=20,
        duration_s=1,
    )
    assert after.user("user-b").requests_completed >= 1


def test_stock_vllm_without_the_flag(
    tiny_model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server(tiny_model_path, ["--max-num-seqs", "32"]) as url:
        assert "OutputRateScheduler" not in url.log_text()
        # The operator's live view on a server without the plugin's admin
        # endpoint: one clear line and exit code 1.
        assert cli.main(["top", "--base-url", url, "--admin-key", "k"]) == 1
        error = capsys.readouterr().err
        assert "no vllm-output-rate admin endpoint" in error
        assert error.count("\n") == 1
        result = load(
            url,
            tiny_model_path,
            [UserLoad("user-a", 3, None)],
            max_tokens=40,
            duration_s=3,
        )
        # Nothing limits user-a: far above the 20 tok/s it gets when limited.
        assert result.user("user-a").rate_tok_s > 100
        # Fields the plugin would refuse are left to vLLM.
        odd_user = post(
            url,
            {
                "model": tiny_model_path,
                "prompt": "hi",
                "max_tokens": 2,
                "vllm_xargs": {"output_rate_user": 5},
            },
        )
        assert odd_user.status_code == 200
