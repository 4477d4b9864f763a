"""What the engine did during a demo run, as an operator's tools see it.

``EngineWatch`` polls the plugin's admin stats endpoint (the same source as
``vllm-output-rate top``) while the load runs: each reading is every user's
cumulative dispatched tokens at the engine's clock, so rates between two
readings are exact engine-side rates, free of HTTP buffering, and the
article's bound can be checked on every pair of readings. After the run,
``first_token_quantiles`` reads the engine-side time-to-first-token
histogram from ``/metrics``, as Prometheus would.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

STATS_PATH = "/v1/output_rate/stats"
FIRST_TOKEN_METRIC = "vllm:output_rate_time_to_first_token_seconds"
BURST_S = 0.1  # the limiter's burst: the bound is (W + 0.1) * limit + 1


@dataclass
class Reading:
    time_s: float  # the engine's monotonic clock (the client's clock too)
    tokens: dict[str, int]


@dataclass
class EngineWatch:
    """Polls the stats endpoint every ``interval_s`` in a thread."""

    base_url: str
    admin_key: str
    interval_s: float = 0.5
    readings: list[Reading] = field(default_factory=list)
    errors: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.read()  # the final counts

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.read()

    def read(self) -> None:
        try:
            page = httpx.get(
                self.base_url + STATS_PATH,
                params={"limit": 10_000},
                headers={"Authorization": f"Bearer {self.admin_key}"},
                timeout=10,
            ).json()
            tokens = {u: int(v["tokens_admitted"]) for u, v in page["users"].items()}
            self.readings.append(Reading(float(page["time_s"]), tokens))
        except (httpx.HTTPError, ValueError, KeyError):
            self.errors += 1  # a missed reading; the next one covers it

    def series(self, user: str, start_s: float) -> tuple[list[float], list[float]]:
        """(times since ``start_s``, tok/s between consecutive readings)."""
        times, rates = [], []
        for a, b in zip(self.readings, self.readings[1:], strict=False):
            if b.time_s > a.time_s:
                delivered = b.tokens.get(user, 0) - a.tokens.get(user, 0)
                times.append(a.time_s - start_s)
                rates.append(delivered / (b.time_s - a.time_s))
        return times, rates

    def rate(self, user: str, start_s: float, end_s: float) -> float | None:
        """Tokens per second between the first and the last reading within
        [``start_s``, ``end_s``] (the load's window, while demand lasted):
        the engine's count, not the client's."""
        inside = [r for r in self.readings if start_s <= r.time_s <= end_s]
        if len(inside) < 2 or inside[-1].time_s <= inside[0].time_s:
            return None
        tokens = inside[-1].tokens.get(user, 0) - inside[0].tokens.get(user, 0)
        return tokens / (inside[-1].time_s - inside[0].time_s)

    def bound_held(self, user: str, limit: float) -> bool:
        """The bound on every pair of readings: the tokens dispatched between
        them (a window of W seconds) are at most (W + 0.1) x limit + 1."""
        points = [(r.time_s, r.tokens.get(user, 0)) for r in self.readings]
        for i, (t0, n0) in enumerate(points):
            for t1, n1 in points[i + 1 :]:
                if n1 - n0 > (t1 - t0 + BURST_S) * limit + 1:
                    return False
        return True


def first_token_quantiles(
    metrics_text: str, quantiles: tuple[float, ...] = (0.5, 0.95)
) -> dict[str, list[float | None]]:
    """Per user label, the engine-side TTFT at each quantile (seconds),
    interpolated within the histogram's buckets like Prometheus'
    ``histogram_quantile``."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != FIRST_TOKEN_METRIC:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets.setdefault(sample.labels["user"], []).append(
                    (bound, sample.value)
                )
    return {
        user: [_quantile(sorted(points), q) for q in quantiles]
        for user, points in buckets.items()
    }


def _quantile(points: list[tuple[float, float]], q: float) -> float | None:
    """``points``: (upper bound, cumulative count), the last one +Inf."""
    total = points[-1][1] if points else 0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in points:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket
            share = (rank - lower_count) / (count - lower_count) if count else 0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return None
