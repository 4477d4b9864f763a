"""Did a run's users load the server at the same time? ``light_window_covered``.

A scene shows something only while the other users' streams hold the scarce
resource as the light user asks. Each user's client runs in a process of its
own; if one of them starts late (a machine that stalls a process, a slow
first connection), the light user may run beside an idle server and come
out "unhurt" on stock vLLM, which says nothing about vLLM. The demo checks
that it did not happen: the share of the light user's window (its first
request sent to its last answer, within the run) during which the others
had at least one request in flight, on the machine's monotonic clock
(``LoadResult.window_opened_s``). Pure: tested without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm_output_rate.demo.scenes import Scene
from vllm_output_rate.loadtest import LoadResult

# The others' load must cover at least this share of the light user's window
# for a run to show the scene (run.py plays it again otherwise).
MIN_COVERED = 0.9

Interval = tuple[float, float]


def request_intervals(result: LoadResult) -> list[Interval]:
    """Each request's time in flight, on the monotonic clock."""
    if result.window_opened_s is None:
        return []
    zero, end = result.window_opened_s, result.elapsed_s
    return [
        (zero + r.start_s, zero + (end if r.end_s is None else r.end_s))
        for r in result.records
    ]


def light_window(result: LoadResult) -> Interval | None:
    """The light user's first request sent to its last answer within the
    run's window, on the monotonic clock."""
    if result.window_opened_s is None or not result.records:
        return None
    zero, duration = result.window_opened_s, result.spec.duration_s
    first = min(r.start_s for r in result.records)
    last = max(r.end_s if r.end_s is not None else duration for r in result.records)
    return zero + first, zero + min(last, duration)


def covered_share(window: Interval, intervals: Iterable[Interval]) -> float:
    """The share of ``window`` that the union of ``intervals`` covers."""
    start, end = window
    if end <= start:
        return 0.0
    covered, reached = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, reached), min(high, end)
        if high > low:
            covered += high - low
            reached = high
    return covered / (end - start)


def light_window_covered(
    scene: Scene, results: Mapping[str, LoadResult]
) -> float | None:
    """The least share of a light user's window that the other users' requests
    covered; None when it cannot be told (no light user, no records, or
    results without their window's clock reading)."""
    others = [
        interval
        for user in scene.users
        if user.role != "light"
        for interval in request_intervals(results[user.name])
    ]
    shares = [
        covered_share(window, others)
        for user in scene.with_role("light")
        if (window := light_window(results[user.name])) is not None
    ]
    return min(shares) if shares else None
