"""Load generator and measurement tool for per-user output-token rates.

Drives a vLLM OpenAI-compatible server with one or more *users*, each with a
number of concurrent *streams*.  A stream is a loop: send one streaming request
(completions or chat), consume it to the end, send the next, until
``LoadSpec.duration_s`` has passed since the start.  A request in flight at the
deadline is allowed to finish; no request is started after it.  Users are
named per request with ``vllm_xargs: {"output_rate_user": NAME}``; a user with
``name=None`` sends no such field (the server's anonymous user).

Every request records the arrival time of each streamed chunk and how many
tokens it carried, so the summaries (``summarize``) are pure functions of the
records and can be tested without a server.

How tokens are counted
----------------------
By default each request asks for ``"return_token_ids": true`` (a vLLM
extension): every streamed choice then carries ``token_ids``, the exact delta
tokens, and the client counts ``len(token_ids)``.  This matters because vLLM
does *not* promise one token per chunk: when the API server's event loop falls
behind the engine it merges pending deltas into one chunk
(``RequestOutputCollector``), and a chunk can carry a token whose text is
still empty (an incomplete UTF-8 sequence held back by the detokenizer).
With ``return_token_ids=False`` the client falls back to one token per chunk
that has a choice (chat's initial role-only chunk excluded), which is exact
only while the server keeps up.  Either way the final usage chunk
(``stream_options.include_usage``) gives the server's ``completion_tokens``,
and the summaries report any request where the two disagree.

Measurement caveat
------------------
Times are taken on the client (``time.monotonic()``, in seconds since the run
started) when a chunk's SSE event is parsed, i.e. after the server's output
coalescing and HTTP/TCP buffering.  Long-run averages (the per-user rate over
its first-to-last-token span, the 1-second bins) are meaningful; individual
gaps between tokens are not.  See ``CAVEAT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import httpx

USER_FIELD = "output_rate_user"
ANONYMOUS_LABEL = "(anonymous)"
DEFAULT_PROMPT = (
    "Tell a long story about a train journey through the mountains, "
    "with many details about the passengers and the places they pass."
)
# Slack of the specification's bound check: tokens <= (span + 0.1) * limit + 1.
BOUND_SLACK_S = 0.1
BOUND_SLACK_TOKENS = 1
# The client times tokens after HTTP buffering, which can shorten a user's
# apparent span a little; the engine-side bound itself is exact (and tested
# at scheduler level). Saturated users sit exactly on the bound, so without
# this tolerance the client-side check would flap on jitter alone.
CLIENT_TIMING_SLACK_S = 0.25
# Pause after a failed request before a stream tries again, so that a dead
# server or a rejected request does not turn into a tight retry loop.
FAILURE_BACKOFF_S = 0.5
PREFLIGHT_TIMEOUT_S = 10.0
JSON_FORMAT = "vllm-output-rate-load/1"

CAVEAT = (
    "Note: tokens are timed when their SSE chunk reaches this client, after the "
    "server's output coalescing and HTTP/TCP buffering. Long-run averages are "
    "meaningful; individual gaps between tokens are not."
)

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}


class LoadError(RuntimeError):
    """The load could not be run at all (e.g. the server is unreachable)."""


# --------------------------------------------------------------------------
# Specification
# --------------------------------------------------------------------------


@dataclass
class UserLoad:
    """One user: ``streams`` concurrent request loops under one name.

    ``name=None`` means requests carry no ``output_rate_user`` (anonymous).
    ``limit`` (tokens/s) is what the server is expected to enforce for this
    user; the client does not send it, it only uses it for the bound check.
    """

    name: str | None
    streams: int
    limit: float | None = None

    @property
    def label(self) -> str:
        return user_label(self.name)


@dataclass
class LoadSpec:
    """What to run.  ``base_url`` is the server root (a trailing ``/v1`` is
    accepted and ignored), e.g. ``http://127.0.0.1:8000``.

    ``extra_body`` is merged into every request body last (its
    ``vllm_xargs``, if any, is merged with the user's).  ``return_token_ids``
    asks vLLM for the token ids of each chunk, which makes the client's token
    count exact; see the module docstring.
    """

    base_url: str
    model: str
    users: list[UserLoad]
    max_tokens: int = 200
    duration_s: float = 20.0
    prompt: str = DEFAULT_PROMPT
    endpoint: Endpoint = "completions"
    ignore_eos: bool = True
    request_timeout_s: float = 300.0
    extra_body: dict[str, Any] | None = None
    return_token_ids: bool = True

    def __post_init__(self) -> None:
        self.base_url = str(self.base_url)
        self.users = list(self.users)
        if not self.users:
            raise ValueError("LoadSpec.users is empty")
        seen: set[str | None] = set()
        for user in self.users:
            if user.name is not None and (
                not isinstance(user.name, str) or not user.name
            ):
                raise ValueError(
                    f"user name must be a non-empty string or None, got {user.name!r}"
                )
            if user.name in seen:
                raise ValueError(f"user {user.label} is listed twice")
            seen.add(user.name)
            if int(user.streams) != user.streams or user.streams < 1:
                raise ValueError(
                    f"user {user.label}: streams must be an integer "
                    f">= 1, got {user.streams!r}"
                )
            if user.limit is not None and not (
                math.isfinite(user.limit) and user.limit > 0
            ):
                raise ValueError(
                    f"user {user.label}: limit must be > 0 tokens/s, got {user.limit!r}"
                )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(
                f"request_timeout_s must be > 0, got {self.request_timeout_s}"
            )
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(
                f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, "
                f"got {self.endpoint!r}"
            )


def user_label(name: str | None) -> str:
    """How a user is shown in tables, plots and progress lines."""
    return ANONYMOUS_LABEL if name is None else name


def normalize_base_url(base_url: str) -> str:
    """``http://h:8000/``, ``http://h:8000/v1`` -> ``http://h:8000``."""
    url = base_url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def build_request_body(spec: LoadSpec, user: UserLoad) -> dict[str, Any]:
    """The JSON body of every request a stream of ``user`` sends (pure)."""
    body: dict[str, Any] = {"model": spec.model}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(
        {
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": spec.ignore_eos,
        }
    )
    if spec.return_token_ids:
        body["return_token_ids"] = True
    extra = dict(spec.extra_body or {})
    xargs = dict(extra.pop("vllm_xargs", None) or {})
    body.update(extra)
    if user.name is not None:
        xargs[USER_FIELD] = user.name
    if xargs:
        body["vllm_xargs"] = xargs
    return body


# --------------------------------------------------------------------------
# Records and summaries
# --------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request as the client saw it.

    Times are seconds since the run started (``time.monotonic()`` based).
    ``chunks`` holds ``(arrival_time, tokens_in_chunk)`` for every streamed
    chunk that carried at least one token.
    """

    user: str | None
    stream: int
    start_s: float
    end_s: float | None = None
    first_token_s: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finish_reason: str | None = None
    usage_completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ok(self) -> bool:
        """Completed: HTTP 200, no error, and a finish_reason was received."""
        return (
            self.error is None and self.status == 200 and self.finish_reason is not None
        )

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.start_s

    def add_chunk(self, t: float, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = t
        self.chunks.append((t, tokens))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [[t, n] for t, n in self.chunks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        d = dict(d)
        d["chunks"] = [(float(t), int(n)) for t, n in d.get("chunks", [])]
        return cls(**d)


@dataclass
class UserSummary:
    """Per-user results; see ``summarize`` for the definitions."""

    name: str | None
    limit: float | None
    streams: int
    requests_completed: int
    requests_failed: int
    tokens_client: int
    tokens_server: int
    token_count_mismatches: int
    first_token_s: float | None
    last_token_s: float | None
    span_s: float
    rate_tok_s: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    bound_allowance: float | None
    bound_ok: bool | None
    series_tok_s: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return user_label(self.name)

    @property
    def tokens_agree(self) -> bool:
        """Every request with a usage chunk: client count == completion_tokens."""
        return self.token_count_mismatches == 0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear interpolation between closest
    ranks (numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def span_rate(first_s: float | None, last_s: float | None, tokens: int) -> float | None:
    """The specification's rate: ``(tokens - 1) / (last - first)``.

    The first token starts the clock, so it is not counted.  None when
    undefined (fewer than two tokens, or all tokens at one instant).
    """
    if first_s is None or last_s is None or tokens < 2:
        return None
    span = last_s - first_s
    if span <= 0:
        return None
    return (tokens - 1) / span


def bound_allowance(span_s: float, limit: float) -> float:
    """Tokens a user limited to ``limit`` tok/s may receive within ``span_s``.

    The specification's ``(W + 0.1) * limit + 1``, with W widened by
    ``CLIENT_TIMING_SLACK_S`` for client-side timing.
    """
    return (span_s + BOUND_SLACK_S + CLIENT_TIMING_SLACK_S) * limit + BOUND_SLACK_TOKENS


def bin_rates(
    chunks: Iterable[tuple[float, int]], horizon_s: float, bin_s: float = 1.0
) -> list[float]:
    """Tokens per second in consecutive bins ``[k*bin_s, (k+1)*bin_s)``.

    Covers ``[0, horizon_s)``; the bin count is ``ceil(horizon_s / bin_s)``,
    extended if a chunk arrives later.  The last bin may be partial and is
    still divided by the full ``bin_s``.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    counts = [0] * max(0, math.ceil(horizon_s / bin_s - 1e-9))
    for t, n in chunks:
        k = max(0, int(t // bin_s))
        if k >= len(counts):
            counts.extend([0] * (k + 1 - len(counts)))
        counts[k] += n
    return [c / bin_s for c in counts]


def summarize_user(
    user: UserLoad,
    records: Sequence[RequestRecord],
    horizon_s: float,
    bin_s: float = 1.0,
) -> UserSummary:
    """Summarize the records of one user (pure).

    - tokens_client: tokens the client counted over all its requests (failed
      ones included: they were delivered); tokens_server: the sum of usage
      ``completion_tokens`` over requests that reported usage;
      token_count_mismatches: requests whose two counts differ.
    - rate_tok_s: ``(tokens_client - 1) / span`` where span runs from the
      user's first to its last token across all its streams.
    - bound_ok (only with a limit): ``tokens_client <= (span + 0.1 + 0.25) *
      limit + 1`` (0.25 s of client-side timing tolerance).
    - TTFT percentiles over requests that received a token.
    - series_tok_s: tokens/s in ``bin_s`` bins from the run start.
    """
    mine = [r for r in records if r.user == user.name]
    chunks = [c for r in mine for c in r.chunks]
    times = [t for t, _ in chunks]
    first = min(times) if times else None
    last = max(times) if times else None
    span = last - first if first is not None and last is not None else 0.0
    tokens = sum(n for _, n in chunks)
    with_usage = [r for r in mine if r.usage_completion_tokens is not None]
    ttfts = [r.ttft_s * 1000.0 for r in mine if r.ttft_s is not None]
    allowance = bound_allowance(span, user.limit) if user.limit is not None else None
    return UserSummary(
        name=user.name,
        limit=user.limit,
        streams=user.streams,
        requests_completed=sum(1 for r in mine if r.ok),
        requests_failed=sum(1 for r in mine if not r.ok),
        tokens_client=tokens,
        tokens_server=sum(r.usage_completion_tokens or 0 for r in with_usage),
        token_count_mismatches=sum(
            1 for r in with_usage if r.tokens != r.usage_completion_tokens
        ),
        first_token_s=first,
        last_token_s=last,
        span_s=span,
        rate_tok_s=span_rate(first, last, tokens),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
        bound_allowance=allowance,
        bound_ok=None if allowance is None else tokens <= allowance,
        series_tok_s=bin_rates(chunks, horizon_s, bin_s),
    )


def summarize(
    users: Sequence[UserLoad],
    records: Sequence[RequestRecord],
    horizon_s: float,
    bin_s: float = 1.0,
) -> list[UserSummary]:
    """Per-user summaries, in the order of ``users`` (pure)."""
    return [summarize_user(u, records, horizon_s, bin_s) for u in users]


# --------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------


@dataclass
class LoadResult:
    """Everything a run produced.  ``elapsed_s`` runs from the start to the
    end of the last request; ``users`` is in the order of ``spec.users``."""

    spec: LoadSpec
    started_at: str
    elapsed_s: float
    records: list[RequestRecord]
    users: list[UserSummary]
    bin_s: float = 1.0

    @classmethod
    def build(
        cls,
        spec: LoadSpec,
        records: list[RequestRecord],
        elapsed_s: float,
        started_at: str = "",
        bin_s: float = 1.0,
    ) -> LoadResult:
        return cls(
            spec=spec,
            started_at=started_at,
            elapsed_s=elapsed_s,
            records=records,
            users=summarize(spec.users, records, elapsed_s, bin_s),
            bin_s=bin_s,
        )

    @property
    def failed_requests(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.ok]

    @property
    def ok(self) -> bool:
        """True when no request failed."""
        return not self.failed_requests

    @property
    def total_tokens(self) -> int:
        return sum(u.tokens_client for u in self.users)

    def user(self, name: str | None) -> UserSummary:
        for u in self.users:
            if u.name == name:
                return u
        raise KeyError(name)

    def error_summary(self, limit: int = 5) -> list[str]:
        """The most common error texts of failed requests, with counts."""
        counts: dict[str, int] = {}
        for r in self.failed_requests:
            text = r.error or f"HTTP {r.status}"
            counts[text] = counts.get(text, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        return [f"{n} x {text}" for text, n in ranked[:limit]]

    def to_dict(self, include_chunks: bool = True) -> dict[str, Any]:
        spec = asdict(self.spec)
        records = []
        for r in self.records:
            d = r.to_dict()
            if not include_chunks:
                d["chunks"] = []
                d["tokens"] = r.tokens
            records.append(d)
        users = []
        for u in self.users:
            d = asdict(u)
            d["label"] = u.label
            d["tokens_agree"] = u.tokens_agree
            users.append(d)
        return {
            "format": JSON_FORMAT,
            "started_at": self.started_at,
            "elapsed_s": self.elapsed_s,
            "bin_s": self.bin_s,
            "caveat": CAVEAT,
            "spec": spec,
            "users": users,
            "records": records,
        }

    def to_json(self, indent: int | None = 2, include_chunks: bool = True) -> str:
        return json.dumps(self.to_dict(include_chunks=include_chunks), indent=indent)

    def write_json(self, path: str | Path, include_chunks: bool = True) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json(include_chunks=include_chunks) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadResult:
        """Rebuild a result from ``to_dict()`` output (summaries recomputed;
        with ``include_chunks=False`` the per-chunk data, and so the rates,
        cannot be recomputed: use the stored ``users`` instead)."""
        spec_d = dict(d["spec"])
        spec_d["users"] = [UserLoad(**u) for u in spec_d["users"]]
        spec = LoadSpec(**spec_d)
        records = []
        for r in d["records"]:
            r = {k: v for k, v in r.items() if k != "tokens"}
            records.append(RequestRecord.from_dict(r))
        return cls.build(
            spec,
            records,
            float(d["elapsed_s"]),
            started_at=d.get("started_at", ""),
            bin_s=float(d.get("bin_s", 1.0)),
        )

    @classmethod
    def read_json(cls, path: str | Path) -> LoadResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


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


# --------------------------------------------------------------------------
# Streaming client
# --------------------------------------------------------------------------


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the ``data`` payload of each server-sent event.

    Multi-line ``data:`` fields are joined with newlines; comments (``:``)
    and other fields (``event:``, ``id:``) are ignored.
    """
    buf: list[str] = []
    async for line in lines:
        if line == "":
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            buf.append(value[1:] if value.startswith(" ") else value)
    if buf:
        yield "\n".join(buf)


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


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(payload)


def _http_error_text(status: int, raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").strip()
    with contextlib.suppress(ValueError):
        text = _error_text(json.loads(text))
    if len(text) > 500:
        text = text[:500] + "..."
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


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
        while time.monotonic() < self.deadline:
            record = RequestRecord(user=user.name, stream=index, start_s=self.now())
            self.records.append(record)
            self.in_flight += 1
            try:
                await asyncio.wait_for(
                    self._request(body, record), self.spec.request_timeout_s
                )
            except asyncio.TimeoutError:
                record.error = (
                    f"timed out after {self.spec.request_timeout_s:g} s "
                    f"({record.tokens} tokens received)"
                )
            finally:
                self.in_flight -= 1
                record.end_s = self.now()
            if not record.ok:
                remaining = self.deadline - time.monotonic()
                if remaining > 0:
                    await asyncio.sleep(min(FAILURE_BACKOFF_S, remaining))

    async def _request(self, body: dict[str, Any], record: RequestRecord) -> None:
        url = str(self.client.base_url).rstrip("/") + self.path
        try:
            async with self.client.stream("POST", self.path, json=body) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    raw = await response.aread()
                    record.error = _http_error_text(response.status_code, raw)
                    return
                await self._consume(response, record)
        except httpx.TransportError as exc:
            detail = str(exc) or type(exc).__name__
            record.error = f"{type(exc).__name__} on {url}: {detail}"

    async def _consume(self, response: httpx.Response, record: RequestRecord) -> None:
        endpoint = self.spec.endpoint
        done = False
        async for data in iter_sse_data(response.aiter_lines()):
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
                record.error = f"server error in stream: {_error_text(payload)}"
                return
            usage = payload.get("usage")
            if isinstance(usage, dict) and not payload.get("choices"):
                tokens = usage.get("completion_tokens")
                if isinstance(tokens, int):
                    record.usage_completion_tokens = tokens
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
                else:
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


async def preflight(
    client: httpx.AsyncClient, base_url: str, model: str | None
) -> None:
    """Check that the server answers; if it lists models, that ``model`` is one.

    Raises LoadError naming the URL that could not be reached.
    """
    url = f"{base_url}/v1/models"
    try:
        response = await client.get("/v1/models", timeout=PREFLIGHT_TIMEOUT_S)
    except httpx.TransportError as exc:
        detail = str(exc) or type(exc).__name__
        raise LoadError(
            f"could not reach the vLLM server at {url} ({type(exc).__name__}: "
            f"{detail}); is it running and is --base-url right?"
        ) from exc
    if model is None or response.status_code != 200:
        return
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        ids = [m["id"] for m in response.json()["data"]]
        if ids and model not in ids:
            raise LoadError(
                f"model {model!r} is not served at {base_url}; it serves: "
                + ", ".join(ids)
            )


async def list_models(
    base_url: str, timeout_s: float = PREFLIGHT_TIMEOUT_S
) -> list[str]:
    """Model ids from ``GET {base_url}/v1/models``; LoadError if unreachable."""
    base = normalize_base_url(base_url)
    url = f"{base}/v1/models"
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s) as client:
        try:
            response = await client.get("/v1/models")
        except httpx.TransportError as exc:
            detail = str(exc) or type(exc).__name__
            raise LoadError(
                f"could not reach the vLLM server at {url} ({type(exc).__name__}: "
                f"{detail}); is it running and is --base-url right?"
            ) from exc
    if response.status_code != 200:
        raise LoadError(
            f"{url} answered {_http_error_text(response.status_code, response.content)}"
        )
    try:
        return [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"{url} returned an unexpected body: {exc}") from exc


def list_models_sync(
    base_url: str, timeout_s: float = PREFLIGHT_TIMEOUT_S
) -> list[str]:
    return asyncio.run(list_models(base_url, timeout_s))


async def run_load(
    spec: LoadSpec,
    progress: Callable[[ProgressSnapshot], None] | None = None,
    *,
    progress_interval_s: float = 0.5,
    bin_s: float = 1.0,
) -> LoadResult:
    """Run ``spec`` against the server and return the measurements.

    Raises LoadError if the server cannot be reached (or does not serve
    ``spec.model``).  Failed requests do not raise: they are recorded
    (``LoadResult.failed_requests``) and the stream pauses briefly and
    carries on.  See the module docstring for the measurement caveat.
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
        await preflight(client, base, spec.model)
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
    return LoadResult.build(spec, run.records, elapsed, started_at, bin_s)


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
