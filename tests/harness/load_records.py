"""Synthetic request records and results for the load tool's pure tests."""

from __future__ import annotations

from vllm_output_rate.loadtest import LoadResult, LoadSpec, RequestRecord, UserLoad


def record(
    user: str | None,
    start: float,
    times: list[float],
    *,
    stream: int = 0,
    per_chunk: int = 1,
    usage: int | None = -1,
    finish: str | None = "length",
    status: int | None = 200,
    error: str | None = None,
) -> RequestRecord:
    """A record with one chunk of ``per_chunk`` tokens at each of ``times``;
    ``usage=-1`` means 'what the client counted'."""
    r = RequestRecord(user=user, stream=stream, start_s=start)
    for t in times:
        r.add_chunk(t, per_chunk)
    r.end_s = times[-1] if times else start
    r.finish_reason = finish
    r.usage_completion_tokens = r.tokens if usage == -1 else usage
    r.status = status
    r.error = error
    return r


def synthetic_result() -> LoadResult:
    """Three users over 3 s: user-a (2 streams, limit 30), user-b (no limit)
    and the anonymous user, whose one request failed with HTTP 503."""
    users = [
        UserLoad("user-a", 2, limit=30.0),
        UserLoad("user-b", 1),
        UserLoad(None, 1),
    ]
    spec = LoadSpec("http://x", "m", users, max_tokens=4, duration_s=3.0)
    records = [
        record("user-a", 0.0, [0.5, 0.6, 0.7, 0.8]),
        record("user-a", 0.0, [0.55, 0.65, 0.75, 0.85], stream=1),
        record("user-b", 0.0, [1.0, 1.5, 2.0, 2.5]),
        record(
            None,
            0.0,
            [0.2],
            usage=None,
            finish=None,
            status=503,
            error="HTTP 503: overloaded",
        ),
    ]
    return LoadResult.build(spec, records, elapsed_s=3.0)


# The first bytes of every PNG file: how the tests know a chart was written.
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
