"""The load tool and its CLI against a real stock vLLM server (one server,
started once for the module)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.load_records import PNG_MAGIC
from vllm_output_rate import cli
from vllm_output_rate.demo.server import RunningServer, running_server
from vllm_output_rate.loadtest import (
    LoadSpec,
    UserLoad,
    list_models_sync,
    run_load_sync,
)
from vllm_output_rate.loadtest.report import format_table, plot_rates
from vllm_output_rate.loadtest.spec import ENDPOINT_PATHS, build_request_body
from vllm_output_rate.loadtest.sse import UNICODE_LINE_BREAKS, sse_data

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stock_server(
    tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with running_server(
        tiny_model_path,
        [],
        env={"VLLM_PLUGINS": ""},  # stock vLLM: keep our plugin out
        log_dir=tmp_path_factory.mktemp("stock-server"),
    ) as url:
        yield url


@pytest.fixture(scope="module")
def model_name(stock_server: str) -> str:
    return list_models_sync(stock_server)[0]


@pytest.mark.timeout(600)
def test_e2e_stock_vllm(stock_server: str, model_name: str, tmp_path: Path, capsys):
    max_tokens = 64
    spec = LoadSpec(
        base_url=stock_server,
        model=model_name,
        users=[UserLoad("user-a", 2, limit=50.0), UserLoad("user-b", 1)],
        max_tokens=max_tokens,
        duration_s=5.0,
    )
    result = run_load_sync(spec)
    assert result.ok, result.error_summary()
    assert len(result.records) >= 3
    for r in result.records:
        assert r.tokens == r.usage_completion_tokens == max_tokens
        assert r.finish_reason == "length"
        assert r.start_s < spec.duration_s
    for u in result.users:
        assert u.tokens_client == u.tokens_server > 0
        assert u.requests_completed >= u.streams
        assert u.rate_tok_s is not None and u.rate_tok_s > 0
    table = format_table(result)
    assert "user-a" in table and "user-b" in table
    png = plot_rates({"stock vLLM": result}, tmp_path / "rates.png")
    assert png.read_bytes().startswith(PNG_MAGIC)

    # Without token ids the client counts one token per chunk. That is exact
    # only while the API server keeps up: when it falls behind (on a busy
    # machine) vLLM merges deltas into one chunk, the client undercounts and
    # the summary must say so rather than report a wrong count as agreed.
    fallback = run_load_sync(
        LoadSpec(
            stock_server,
            spec.model,
            [UserLoad("solo", 1)],
            max_tokens=max_tokens,
            duration_s=1.0,
            return_token_ids=False,
        )
    )
    assert fallback.ok, fallback.error_summary()
    counts = [(r.tokens, r.usage_completion_tokens) for r in fallback.records]
    assert all(0 < client <= server == max_tokens for client, server in counts), counts
    merged = sum(1 for client, server in counts if client != server)
    assert fallback.users[0].token_count_mismatches == merged, counts

    # The CLI, chat endpoint, model discovered from /v1/models.
    out_json, out_png = tmp_path / "cli.json", tmp_path / "cli.png"
    code = cli.main(
        [
            "load",
            "--base-url",
            stock_server,
            "--users",
            "user-a:1,-:1",
            "--limits",
            "user-a:1000",
            "--endpoint",
            "chat",
            "--max-tokens",
            "16",
            "--duration",
            "2",
            "--quiet",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out_json.read_text())
    assert all(r["tokens_client"] == r["tokens_server"] > 0 for r in data["users"])
    assert all(
        sum(n for _, n in r["chunks"]) == r["usage_completion_tokens"] == 16
        for r in data["records"]
    )
    assert out_png.read_bytes().startswith(PNG_MAGIC)
    assert "bound held" in captured.out


# The characters httpx's aiter_lines() ended lines at besides CR/LF, each
# between letters. vLLM writes U+0085, U+2028 and U+2029 unescaped in its JSON.
LINE_BREAK_TEXT = (
    "".join(f"{c}{ch}" for c, ch in zip("abcdefgh", UNICODE_LINE_BREAKS, strict=True))
    + "i"
)
# Structured outputs (a single choice) make the random tiny model emit exactly
# that text, one byte-level token at a time; temperature 0 keeps it repeatable.
EMIT_LINE_BREAKS = {
    "structured_outputs": {"choice": [LINE_BREAK_TEXT]},
    "temperature": 0.0,
}


def _streamed_text(raw: bytes, endpoint: str) -> str:
    """The text of a streamed response's chunks, read with sse_data."""

    async def collect() -> str:
        response = httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=raw
        )
        parts = []
        async for data in sse_data(response):
            if data == "[DONE]":
                break
            for choice in json.loads(data)["choices"]:
                part = (
                    choice["delta"].get("content")
                    if endpoint == "chat"
                    else choice["text"]
                )
                parts.append(part or "")
        return "".join(parts)

    return asyncio.run(collect())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_text_with_unicode_line_breaks(
    stock_server: str, model_name: str, endpoint: Any
):
    spec = LoadSpec(
        stock_server,
        model_name,
        [UserLoad("user-a", 2), UserLoad(None, 1)],
        max_tokens=64,
        duration_s=1.0,
        endpoint=endpoint,
        ignore_eos=False,  # the choice ends with EOS
        extra_body=EMIT_LINE_BREAKS,
    )
    # The server really streams the text, with the characters unescaped.
    body = build_request_body(spec, spec.users[0])
    with httpx.stream(
        "POST", stock_server + ENDPOINT_PATHS[endpoint], json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        raw = response.read()
    assert all(c.encode() in raw for c in "\x85\u2028\u2029")
    assert _streamed_text(raw, endpoint) == LINE_BREAK_TEXT

    # The load tool reads every such stream to its end.
    result = run_load_sync(spec)
    assert result.ok, result.error_summary()
    assert len(result.records) >= 3
    for r in result.records:
        assert r.finish_reason == "stop"
        assert r.tokens == r.usage_completion_tokens > len(LINE_BREAK_TEXT)
