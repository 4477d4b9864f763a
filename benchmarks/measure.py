"""What the measuring modules share: progress lines, the statistics every
benchmark reports (median, quartiles), client-side token counts, a server's
``vllm:`` metrics and whether it has drained."""

from __future__ import annotations

import contextlib
import math
import re
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence

import httpx

from vllm_output_rate.loadtest import LoadResult
from vllm_output_rate.loadtest.summary import percentile


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def quartiles(values: Sequence[float | None]) -> tuple[float, float]:
    """First and third quartile of the numbers among ``values`` (NaN, NaN
    if none)."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return float("nan"), float("nan")
    return percentile(xs, 25), percentile(xs, 75)


def against_stock(times_ns: Mapping[str, Sequence[int]]) -> dict[str, dict[str, float]]:
    """Step times of schedulers stepped side by side (one sample each per
    round, ``"stock"`` among them): per scheduler its median step in ms and
    the median over rounds of its step / stock's in the same round."""
    stock = times_ns["stock"]
    return {
        name: {
            "step_ms": statistics.median(ns) / 1e6,
            "ratio": statistics.median(a / b for a, b in zip(ns, stock, strict=True)),
        }
        for name, ns in times_ns.items()
    }


def median_us(samples_ns: Sequence[int]) -> float:
    """Median of timings in ns, in µs (the scheduler benchmarks' unit)."""
    return statistics.median(samples_ns) / 1e3


def tokens_between(result: LoadResult, user: str | None, lo: float, hi: float) -> int:
    """Tokens the client received for ``user`` between ``lo`` and ``hi``
    seconds into the load."""
    return sum(
        n
        for r in result.records
        if r.user == user
        for t, n in r.chunks
        if lo <= t <= hi
    )


def metric_totals(url: str) -> dict[str, float]:
    """Every ``vllm:`` metric on the server's ``/metrics``, summed over its
    labels."""
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            name, _, value = match.groups()
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def wait_until_drained(url: str, timeout_s: float = 30.0) -> bool:
    """Wait until the server has no running or waiting request (a stream
    cut at the end of a load stays queued until vLLM writes to it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            totals = metric_totals(url)
            busy = totals.get("vllm:num_requests_running", 0.0) + totals.get(
                "vllm:num_requests_waiting", 0.0
            )
            if busy == 0:
                return True
        time.sleep(0.5)
    return False
