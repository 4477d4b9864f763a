"""The streaming client: runs a ``LoadSpec`` against a vLLM OpenAI server.

``run_load`` checks that the server answers (``server_check.py``), starts one task
per stream and returns a ``LoadResult`` once every stream has passed the
deadline and its last request has ended.  A stream is a loop: send one
streaming request, consume it to the end (``sse.sse_data``), record each
chunk's arrival time and token count in a ``RequestRecord``, send the next.
A failed request is recorded, never raised; the stream pauses briefly
(``FAILURE_BACKOFF_S``) and carries on.  Only a server that cannot be reached
at all (or does not serve the model) raises ``LoadError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import httpx

from vllm_output_rate.loadtest.errors import (
    error_code,
    error_text,
    http_error_text,
    transport_detail,
)
from vllm_output_rate.loadtest.results import LoadResult
from vllm_output_rate.loadtest.server_check import PREFLIGHT_TIMEOUT_S, preflight
from vllm_output_rate.loadtest.spec import (
    ENDPOINT_PATHS,
    Endpoint,
    LoadSpec,
    UserLoad,
    any_api_key,
    build_request_body,
    normalize_base_url,
    request_headers,
    user_label,
)
from vllm_output_rate.loadtest.sse import sse_data
from vllm_output_rate.loadtest.summary import RequestRecord

# Pause after a failed request before a stream tries again, so that a dead
# server or a rejected request does not turn into a tight retry loop.
FAILURE_BACKOFF_S = 0.5


@dataclass
class ProgressSnapshot:
    """Live counters, handed to the ``progress`` callback about twice a
    second and once at the end (``done=True``).  Keys are user labels."""

    elapsed_s: float
    duration_s: float
    tokens: dict[str, int]
    requests_completed: dict[str, int]
    requests_failed: dict[str, int]
    in_flight: int
    done: bool = False


def count_chunk_tokens(choice: dict[str, Any], endpoint: Endpoint) -> int:
    """Tokens carried by one streamed choice.

    Exact when the server returned ``token_ids`` (``return_token_ids``);
    otherwise one per chunk, except chat's role-only opening chunk.
    """
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        has_text = any(
            delta.get(k) for k in ("content", "reasoning", "reasoning_content")
        )
        if "role" in delta and not has_text:
            return 0
    return 1


def retry_after_s(headers: httpx.Headers) -> float | None:
    """A refusal's ``retry-after-ms`` (else ``retry-after``), in seconds."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        with contextlib.suppress(KeyError, ValueError):
            value = float(headers[name]) / scale
            if value >= 0:
                return value
    return None


class _Run:
    """State of one ``run_load`` call."""

    def __init__(self, spec: LoadSpec, client: httpx.AsyncClient, t0: float):
        self.spec = spec
        self.client = client
        self.t0 = t0
        self.deadline = t0 + spec.duration_s
        self.path = ENDPOINT_PATHS[spec.endpoint]
        self.records: list[RequestRecord] = []
        self.in_flight = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def stream_loop(self, user: UserLoad, index: int) -> None:
        body = build_request_body(self.spec, user)
        headers = request_headers(self.spec, user)
        while time.monotonic() < self.deadline:
            record = RequestRecord(user=user.name, stream=index, start_s=self.now())
            self.records.append(record)
            self.in_flight += 1
            try:
                await asyncio.wait_for(
                    self._request(body, headers, record), self.spec.request_timeout_s
                )
            except asyncio.TimeoutError:
                record.error = (
                    f"timed out after {self.spec.request_timeout_s:g} s "
                    f"({record.tokens} tokens received)"
                )
            finally:
                self.in_flight -= 1
                record.end_s = self.now()
            # After an answer, the user's reading time; after a refusal, a
            # 429's Retry-After (a stream honours it), else a back-off.
            pause = (
                user.think_s
                if record.ok
                else (record.retry_after_s or FAILURE_BACKOFF_S)
            )
            remaining = self.deadline - time.monotonic()
            if pause > 0 and remaining > 0:
                await asyncio.sleep(min(pause, remaining))

    async def _request(
        self, body: dict[str, Any], headers: dict[str, str], record: RequestRecord
    ) -> None:
        url = str(self.client.base_url).rstrip("/") + self.path
        try:
            async with self.client.stream(
                "POST", self.path, json=body, headers=headers
            ) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    record.retry_after_s = retry_after_s(response.headers)
                    raw = await response.aread()
                    record.error = http_error_text(response.status_code, raw)
                    return
                await self._consume(response, record)
        except httpx.TransportError as exc:
            record.error = f"{type(exc).__name__} on {url}: {transport_detail(exc)}"

    async def _consume(self, response: httpx.Response, record: RequestRecord) -> None:
        endpoint = self.spec.endpoint
        done = False
        async for data in sse_data(response):
            t = self.now()
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                payload = json.loads(data)
            except ValueError:
                record.error = f"unparsable SSE data: {data[:200]!r}"
                return
            if not isinstance(payload, dict):
                continue
            if "error" in payload and not payload.get("choices"):
                record.error = f"server error in stream: {error_text(payload)}"
                record.stream_error_status = error_code(payload)
                return
            usage = payload.get("usage")
            if isinstance(usage, dict) and not payload.get("choices"):
                tokens = usage.get("completion_tokens")
                if isinstance(tokens, int):
                    record.usage_completion_tokens = tokens
                # vLLM's --enable-per-request-metrics: the engine's timings.
                metrics = payload.get("metrics")
                if isinstance(metrics, dict):
                    record.engine_metrics = metrics
            for choice in payload.get("choices") or []:
                record.add_chunk(t, count_chunk_tokens(choice, endpoint))
                if choice.get("finish_reason") is not None:
                    record.finish_reason = choice["finish_reason"]
        if record.finish_reason is None:
            record.error = "stream ended without a finish_reason" + (
                "" if done else " (connection closed before [DONE])"
            )

    def snapshot(self, done: bool = False) -> ProgressSnapshot:
        tokens = {u.label: 0 for u in self.spec.users}
        completed = dict.fromkeys(tokens, 0)
        failed = dict.fromkeys(tokens, 0)
        for r in self.records:
            label = user_label(r.user)
            tokens[label] += r.tokens
            if r.end_s is not None:
                if r.ok:
                    completed[label] += 1
                elif not r.rejected:
                    failed[label] += 1
        return ProgressSnapshot(
            elapsed_s=self.now(),
            duration_s=self.spec.duration_s,
            tokens=tokens,
            requests_completed=completed,
            requests_failed=failed,
            in_flight=self.in_flight,
            done=done,
        )


async def run_load(
    spec: LoadSpec,
    progress: Callable[[ProgressSnapshot], None] | None = None,
    *,
    progress_interval_s: float = 0.5,
    bin_s: float = 1.0,
    server_checked: bool = False,
) -> LoadResult:
    """Run ``spec`` against the server and return the measurements.

    Raises LoadError if the server cannot be reached (or does not serve
    ``spec.model``); a caller that checked that already (``check_server``,
    before a start shared with other clients) passes ``server_checked=True``
    so that the window opens at once.  Failed requests do not raise: they are recorded
    (``LoadResult.failed_requests``) and the stream pauses briefly and
    carries on.  See the package docstring for the measurement caveat.
    """
    base = normalize_base_url(spec.base_url)
    total_streams = sum(u.streams for u in spec.users)
    timeout = httpx.Timeout(
        connect=PREFLIGHT_TIMEOUT_S,
        read=spec.request_timeout_s,
        write=PREFLIGHT_TIMEOUT_S,
        pool=None,
    )
    limits = httpx.Limits(
        max_connections=total_streams + 4,
        max_keepalive_connections=total_streams + 4,
    )
    async with httpx.AsyncClient(
        base_url=base, timeout=timeout, limits=limits
    ) as client:
        if not server_checked:
            await preflight(client, base, spec.model, any_api_key(spec.api_keys))
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        run = _Run(spec, client, time.monotonic())
        tasks = [
            asyncio.create_task(run.stream_loop(user, i))
            for user in spec.users
            for i in range(user.streams)
        ]
        ticker = (
            asyncio.create_task(_tick(run, progress, progress_interval_s))
            if progress is not None
            else None
        )
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
        elapsed = max(
            (r.end_s for r in run.records if r.end_s is not None), default=run.now()
        )
        if progress is not None:
            progress(run.snapshot(done=True))
    return LoadResult.build(
        spec, run.records, elapsed, started_at, bin_s, window_opened_s=run.t0
    )


async def _tick(
    run: _Run, progress: Callable[[ProgressSnapshot], None], interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        progress(run.snapshot())


def run_load_sync(
    spec: LoadSpec,
    progress: Callable[[ProgressSnapshot], None] | None = None,
    **kwargs: Any,
) -> LoadResult:
    """``run_load`` for synchronous callers (starts its own event loop)."""
    return asyncio.run(run_load(spec, progress, **kwargs))
