"""sse_data: events end at blank lines, lines only at CR, LF or CRLF."""

from __future__ import annotations

import ast
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import SSEError

from vllm_output_rate.loadtest.sse import UNICODE_LINE_BREAKS, sse_data

EVENT_STREAM = {"content-type": "text/event-stream; charset=utf-8"}


def response(
    raw: bytes, chunk_size: int | None = None, **headers: str
) -> httpx.Response:
    """A streaming response whose body arrives in pieces of ``chunk_size``
    bytes (all at once by default), as from a socket."""
    size = chunk_size or len(raw) or 1

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), size):
            yield raw[i : i + size]

    return httpx.Response(200, headers=headers or EVENT_STREAM, content=body())


def read(resp: httpx.Response) -> list[str]:
    async def collect() -> list[str]:
        return [data async for data in sse_data(resp)]

    return asyncio.run(collect())


def read_lines_the_old_way(resp: httpx.Response) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in resp.aiter_lines()]

    return asyncio.run(collect())


def vllm_chunk(text: str) -> bytes:
    """One completions chunk as vLLM writes it: JSON without ASCII escaping."""
    payload = {"choices": [{"index": 0, "text": text, "token_ids": [7]}]}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def test_fields_comments_and_multiline_data():
    raw = (
        b": a comment\n"
        b'data: {"a": 1}\n'
        b"\n"
        b"event: x\n"
        b"id: 7\n"
        b"data:one\n"
        b"data: two\n"
        b"\n"
        b"event: no-data\n"
        b"\n"
        b"\n"
        b"data: [DONE]\n"
        b"\n"
    )
    assert read(response(raw)) == ['{"a": 1}', "one\ntwo", "[DONE]"]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_of_the_spec(newline):
    raw = b"data: a" + newline + b"data: b" + newline + newline + b"data: c"
    raw += newline + newline
    for chunk_size in (None, 1):  # a CR LF pair may be split between reads
        assert read(response(raw, chunk_size)) == ["a\nb", "c"]


def test_an_event_cut_off_by_the_end_of_the_stream_is_dropped():
    assert read(response(b"data: a\n\ndata: half")) == ["a"]


@pytest.mark.parametrize("char", list(UNICODE_LINE_BREAKS), ids=ascii)
def test_unicode_line_breaks_stay_inside_the_data(char):
    raw = vllm_chunk(f"before{char}after") + b"data: [DONE]\n\n"
    # Byte by byte too: multi-byte UTF-8 characters split between reads.
    for chunk_size in (None, 1):
        events = read(response(raw, chunk_size))
        assert len(events) == 2 and events[1] == "[DONE]"
        assert json.loads(events[0])["choices"][0]["text"] == f"before{char}after"


def test_all_unicode_line_breaks_in_one_stream():
    texts = [f"{i}{c}{c}" for i, c in enumerate(UNICODE_LINE_BREAKS)]
    raw = b"".join(vllm_chunk(t) for t in texts) + b"data: [DONE]\n\n"
    events = read(response(raw, chunk_size=3))
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == texts


def test_the_characters_vllm_sends_unescaped_cut_aiter_lines():
    # Why sse_data exists: JSON leaves U+0085, U+2028 and U+2029 as they are,
    # and httpx's aiter_lines() ends a line at each of them.
    for char in "\x85\u2028\u2029":
        raw = vllm_chunk(f"x{char}y")
        assert char.encode() in raw
        lines = read_lines_the_old_way(response(raw))
        data_line = next(line for line in lines if line.startswith("data: "))
        with pytest.raises(ValueError):
            json.loads(data_line[len("data: ") :])
        assert json.loads(read(response(raw))[0])["choices"][0]["text"] == f"x{char}y"


def test_not_an_event_stream_is_a_transport_error():
    resp = response(b'{"error": "x"}', **{"content-type": "application/json"})
    with pytest.raises(SSEError) as exc:
        read(resp)
    assert isinstance(exc.value, httpx.TransportError)
    assert "text/event-stream" in str(exc.value)


def test_every_sse_reader_is_sse_data():
    # A new stream reader written with aiter_lines()/iter_lines() would bring
    # the bug back; only this test module calls them (to show the bug).
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("src", "benchmarks", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("aiter_lines", "iter_lines")
                    and isinstance(node.ctx, ast.Load)
                ):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
