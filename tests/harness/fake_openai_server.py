"""A scripted OpenAI-style streaming server on 127.0.0.1, for the load tool's
client and CLI tests (fast, no vLLM).

``serving()`` yields ``(base_url, requests_seen)`` (each POST's body, with
its ``path`` and its ``authorization`` header, None when absent).
The model named in a request picks its script:

- ``ok``: one token per chunk, then a usage chunk and ``[DONE]``;
- ``multi``: three tokens per chunk, and per-request timings beside the
  usage (``ENGINE_METRICS``, as vLLM's ``--enable-per-request-metrics``);
- ``bad``: HTTP 400 with an OpenAI error body;
- ``limited``: HTTP 429 with ``retry-after-ms: 150`` and ``retry-after: 1``;
- ``cut``: the connection closes after two chunks, without a finish_reason;
- ``inline-error``: an error event in the middle of the stream;
- ``slow``: 20 ms between chunks;
- ``miscount``: the usage chunk reports one token more than were streamed;
- ``separators``: every chunk's text holds the characters that
  ``str.splitlines()`` ends lines at besides CR/LF (``SEPARATOR_TEXT``),
  written as vLLM writes JSON: U+0085, U+2028 and U+2029 unescaped.

``GET /metrics`` counts, as vLLM's counters do, the requests whose stream it
finished and the tokens it sent (prompt tokens: one per prompt word).

What the real server does is tested end to end against vLLM
(tests/e2e/test_load_tool.py); this one only scripts the cases a real
server will not produce on demand.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm_output_rate.loadtest.sse import UNICODE_LINE_BREAKS

MODELS = [
    "ok",
    "multi",
    "bad",
    "limited",
    "cut",
    "inline-error",
    "slow",
    "miscount",
    "separators",
]
SEPARATOR_TEXT = (
    "".join(f"{c}{ch}" for c, ch in zip("abcdefgh", UNICODE_LINE_BREAKS, strict=True))
    + "i"
)
ENGINE_METRICS = {"queue_time_ms": 1.5, "time_to_first_token_ms": 2.0}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    requests_seen: list[dict[str, Any]]
    finished = 0
    prompt_tokens = 0
    output_tokens = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server: _Server

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": m} for m in MODELS]}).encode())
        elif self.path == "/metrics":
            s = self.server
            counters = {
                'vllm:request_success_total{finished_reason="length"}': s.finished,
                "vllm:prompt_tokens_total": s.prompt_tokens,
                "vllm:generation_tokens_total": s.output_tokens,
            }
            page = "".join(
                f"# TYPE {name.split('{')[0]} counter\n{name} {value}\n"
                for name, value in counters.items()
            )
            self._send(200, page.encode())
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests_seen.append(
            {"path": self.path, "authorization": self.headers["Authorization"], **body}
        )
        model = body["model"]
        if model == "bad":
            err = {"error": {"message": "bad request: nope", "code": 400}}
            self._send(400, json.dumps(err).encode())
            return
        if model == "limited":
            body = json.dumps({"error": {"message": "over cap", "code": 429}})
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("retry-after", "1")
            self.send_header("retry-after-ms", "150")
            self.end_headers()
            self.wfile.write(body.encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.end_headers()
        n = body["max_tokens"]
        per = 3 if model == "multi" else 1
        sent = 0
        while sent < n:
            k = min(per, n - sent)
            sent += k
            if model == "cut" and sent > 2:
                return  # connection closes without a finish_reason
            if model == "inline-error" and sent > 2:
                self._event({"error": {"message": "engine died"}})
                return
            text = SEPARATOR_TEXT if model == "separators" else "x" * k
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": "length" if sent >= n else None,
                "token_ids": list(range(k)),
            }
            self._event({"choices": [choice]})
            time.sleep(0.02 if model == "slow" else 0.002)
        usage = n + 1 if model == "miscount" else n
        final: dict[str, Any] = {"choices": [], "usage": {"completion_tokens": usage}}
        if model == "multi":
            final["metrics"] = ENGINE_METRICS
        self._event(final)
        self.wfile.write(b"data: [DONE]\n\n")
        self.server.finished += 1
        self.server.prompt_tokens += len(str(body.get("prompt", "")).split())
        self.server.output_tokens += n

    def _event(self, payload: dict[str, Any]) -> None:
        # Like vLLM (pydantic's JSON): non-ASCII characters are not escaped.
        data = json.dumps(payload, ensure_ascii=False)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()


@contextmanager
def serving() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Run the server in a thread; yield its base URL and the request bodies
    it received (each with its ``path``), in order."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.requests_seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests_seen
    finally:
        server.shutdown()
        server.server_close()
