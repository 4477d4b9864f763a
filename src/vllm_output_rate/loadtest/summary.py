"""What the client measured, and the pure summaries of it.

``RequestRecord`` is one request as the client saw it: when it started, when
each streamed chunk arrived and how many tokens it carried, how it ended.
``summarize`` turns a run's records into one ``UserSummary`` per user: token
counts (the client's and the server's usage), the rate over the user's
first-to-last-token span, TTFT percentiles, 1-second rate bins and the
specification's bound check.  Everything here is a pure function of the
records, so it is tested without a server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_output_rate.loadtest.spec import UserLoad, user_label

# Slack of the specification's bound check: tokens <= (W + 0.1) * limit + 1.
BOUND_SLACK_S = 0.1
BOUND_SLACK_TOKENS = 1

CAVEAT = (
    "Note: tokens are timed when their SSE chunk reaches this client, after the "
    "server's output coalescing and HTTP/TCP buffering. Long-run averages are "
    "meaningful; individual gaps between tokens are not."
)


@dataclass
class RequestRecord:
    """One request as the client saw it.

    Times are seconds since the run started (``time.monotonic()`` based).
    ``chunks`` holds ``(arrival_time, tokens_in_chunk)`` for every streamed
    chunk that carried at least one token.  ``engine_metrics``: the
    per-request timings a server started with vLLM's
    ``--enable-per-request-metrics`` puts on the final usage chunk
    (``queue_time_ms``, ``time_to_first_token_ms``, ``generation_time_ms``...).
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
    # The HTTP status an error event inside a 200 stream carries (vLLM's
    # second admission check, as a request registers: 503 or 429).
    stream_error_status: int | None = None
    # A 429's Retry-After (retry-after-ms, else retry-after), in seconds.
    retry_after_s: float | None = None
    engine_metrics: dict[str, Any] | None = None

    @property
    def refusal_status(self) -> int | None:
        """The status the server refused it with, in the headers or inside
        the stream; None when it was not refused."""
        if self.stream_error_status is not None:
            return self.stream_error_status
        return self.status if self.status != 200 else None

    @property
    def rejected(self) -> bool:
        """Refused with HTTP 429: the user's own excess, not an error."""
        return self.refusal_status == 429

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
    bound_window_s: float
    rate_tok_s: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    bound_allowance: float | None
    bound_ok: bool | None
    series_tok_s: list[float] = field(default_factory=list)
    # Refused with 429 (not counted as failed), and their median Retry-After.
    requests_rejected: int = 0
    retry_after_p50_s: float | None = None

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


def bound_allowance(window_s: float, limit: float) -> float:
    """Tokens a user limited to ``limit`` tok/s may receive within ``window_s``:
    the specification's ``(W + 0.1) * limit + 1``."""
    return (window_s + BOUND_SLACK_S) * limit + BOUND_SLACK_TOKENS


def bound_window(first_sent_s: float | None, last_token_s: float | None) -> float:
    """The window the client can vouch for: from the user's first request sent
    to its last token received.

    The engine charged every token the user received after that request
    reached it and before that last token reached the client, so this window
    contains every charge and the bound holds in it exactly, however late HTTP
    delivers the first tokens. (The first-to-last-token span does not: when the
    first chunks arrive late, it is shorter than the engine's window, which
    made a client-side check flap on delivery jitter alone.)
    """
    if first_sent_s is None or last_token_s is None:
        return 0.0
    return max(0.0, last_token_s - first_sent_s)


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
    - bound_ok (only with a limit): ``tokens_client <= (window + 0.1) *
      limit + 1``, where the window (``bound_window_s``) runs from the user's
      first request sent to its last token received (see ``bound_window``).
    - TTFT percentiles over requests that received a token.
    - series_tok_s: tokens/s in ``bin_s`` bins from the run start.
    """
    mine = [r for r in records if r.user == user.name]
    chunks = [c for r in mine for c in r.chunks]
    times = [t for t, _ in chunks]
    first = min(times) if times else None
    last = max(times) if times else None
    span = last - first if first is not None and last is not None else 0.0
    window = bound_window(min((r.start_s for r in mine), default=None), last)
    tokens = sum(n for _, n in chunks)
    with_usage = [r for r in mine if r.usage_completion_tokens is not None]
    ttfts = [r.ttft_s * 1000.0 for r in mine if r.ttft_s is not None]
    allowance = bound_allowance(window, user.limit) if user.limit is not None else None
    return UserSummary(
        name=user.name,
        limit=user.limit,
        streams=user.streams,
        requests_completed=sum(1 for r in mine if r.ok),
        requests_failed=sum(1 for r in mine if not r.ok and not r.rejected),
        tokens_client=tokens,
        tokens_server=sum(r.usage_completion_tokens or 0 for r in with_usage),
        token_count_mismatches=sum(
            1 for r in with_usage if r.tokens != r.usage_completion_tokens
        ),
        first_token_s=first,
        last_token_s=last,
        span_s=span,
        bound_window_s=window,
        rate_tok_s=span_rate(first, last, tokens),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
        bound_allowance=allowance,
        bound_ok=None if allowance is None else tokens <= allowance,
        series_tok_s=bin_rates(chunks, horizon_s, bin_s),
        requests_rejected=sum(1 for r in mine if r.rejected),
        retry_after_p50_s=percentile(
            [r.retry_after_s for r in mine if r.retry_after_s is not None], 50
        ),
    )


def summarize(
    users: Sequence[UserLoad],
    records: Sequence[RequestRecord],
    horizon_s: float,
    bin_s: float = 1.0,
) -> list[UserSummary]:
    """Per-user summaries, in the order of ``users`` (pure)."""
    return [summarize_user(u, records, horizon_s, bin_s) for u in users]
