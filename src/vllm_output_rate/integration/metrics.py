"""Prometheus metrics from the engine's per-user counters.

The counters live in the engine-core process; the API server polls a
snapshot of them and this collector renders the latest one on vLLM's own
``/metrics`` (prometheus_client's default registry). Names follow vLLM's
``vllm:`` convention; the ``user`` label is bounded (configured users,
``__anonymous__``, ``__other__``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from vllm_output_rate.config import DEFAULT_KEY, USERS_KEY
from vllm_output_rate.scheduling.stats import GAP_BUCKETS_S

PREFIX = "vllm:output_rate_"


class OutputRateCollector(Collector):
    def __init__(self) -> None:
        self._snapshot: dict[str, Any] | None = None
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            REGISTRY.register(self)
            self._registered = True

    def update(self, snapshot: dict[str, Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        if self._snapshot is None:
            return
        users: dict[str, dict[str, Any]] = self._snapshot["users"]
        counters = {
            "tokens_admitted": "Output tokens dispatched (charged and not refunded)",
            "refunds": "Tokens refunded because the charged step was not dispatched",
            "throttled_request_steps": "Request-steps skipped for lack of budget",
            "reclaimed": "Throttled resident requests preempted for users with budget",
            "recomputed_tokens": "Tokens computed again after a preemption",
        }
        for key, doc in counters.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=["user"])
            for label, values in users.items():
                family.add_metric([label], values[key])
            yield family
        resident = GaugeMetricFamily(
            PREFIX + "resident_throttled_requests",
            "Resident requests skipped for lack of budget in the last step",
            labels=["user"],
        )
        gaps = HistogramMetricFamily(
            PREFIX + "token_gap_seconds",
            "Engine-side gap between a user's consecutive dispatched tokens",
            labels=["user"],
        )
        for label, values in users.items():
            resident.add_metric([label], values["resident_throttled"])
            cumulative, buckets = 0, []
            for bound, count in zip(
                [*map(str, GAP_BUCKETS_S), "+Inf"], values["gap_buckets"], strict=True
            ):
                cumulative += count
                buckets.append((bound, cumulative))
            gaps.add_metric([label], buckets, values["gap_sum_s"])
        yield resident
        yield gaps
        limits = self._snapshot["limits"]
        limit = GaugeMetricFamily(
            PREFIX + "limit_tokens_per_second",
            "Configured limit (__default__: users without their own)",
            labels=["user"],
        )
        limit.add_metric(["__default__"], limits[DEFAULT_KEY])
        for user, rate in limits[USERS_KEY].items():
            limit.add_metric([user], rate)
        yield limit
