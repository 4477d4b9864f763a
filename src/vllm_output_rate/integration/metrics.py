"""Prometheus metrics from the engine's per-label counters.

The counters live in the engine-core process; the API server polls a
snapshot of them and this collector renders the latest one on vLLM's own
``/metrics`` (prometheus_client's default registry). Names follow vLLM's
``vllm:`` convention. The ``user`` label is bounded by the engine
(``scheduling/stats.py: MetricLabels``): the listed users, ``__anonymous__``,
at most ``--output-rate-metrics-recent-users`` users with recent traffic,
and ``__other__`` for everyone else; the limit gauges add ``__default__``.
With prompt-token limits on, prompt tokens are counted and their limit has a
gauge of its own; off, that gauge is absent and the counter stays at 0.
So a scrape costs the same with ten users configured or a million.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from vllm_output_rate.scheduling.stat_records import (
    FIRST_TOKEN_BUCKETS_S,
    GAP_BUCKETS_S,
)

PREFIX = "vllm:output_rate_"
COUNTERS = {
    "tokens_admitted": "Output tokens dispatched (charged and not refunded)",
    "refunds": "Tokens refunded because the charged step was not dispatched",
    "throttled_request_steps": "Request-steps skipped for lack of budget",
    "reclaimed": "Throttled resident requests preempted for users with budget",
    "recomputed_tokens": "Tokens computed again after a preemption",
    "prompt_tokens": "Prompt tokens computed (prefill and recomputation after a "
    "preemption; prefix-cache hits are free), counted only with prompt-token "
    "limits on",
}
HISTOGRAMS = {
    "token_gap": (
        "token_gap_seconds",
        "Engine-side gap between a user's consecutive dispatched tokens",
        GAP_BUCKETS_S,
    ),
    "first_token": (
        "time_to_first_token_seconds",
        "Engine-side time from a request's arrival in the scheduler to the "
        "step that samples its first token",
        FIRST_TOKEN_BUCKETS_S,
    ),
}


class OutputRateCollector(Collector):
    def __init__(self) -> None:
        self._snapshot: dict[str, Any] | None = None
        self._registered = False
        # This API server's admission refusals (integration/admission.py).
        self.admission: Any = None

    def register(self) -> None:
        if not self._registered:
            REGISTRY.register(self)
            self._registered = True

    def update(self, snapshot: dict[str, Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        if self.admission is not None:
            yield admission_metric(self.admission.rejections)
        if self._snapshot is None:
            return
        labels: dict[str, dict[str, Any]] = self._snapshot["labels"]
        for key, doc in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=["user"])
            for label, values in labels.items():
                family.add_metric([label], values[key])
            yield family
        resident = GaugeMetricFamily(
            PREFIX + "resident_throttled_requests",
            "Resident requests skipped for lack of budget in the last step",
            labels=["user"],
        )
        for label, values in labels.items():
            resident.add_metric([label], values["resident_throttled"])
        yield resident
        for key, (name, doc, bounds) in HISTOGRAMS.items():
            yield _histogram(PREFIX + name, doc, bounds, labels, key)
        yield _per_label(
            "limit_tokens_per_second",
            "Each labelled user's limit (__default__: users without their own)",
            self._snapshot["limits"],
        )
        prompt_limits = self._snapshot.get("prompt_limits")
        if prompt_limits is not None:  # prompt-token limits are on
            yield _per_label(
                "prompt_limit_tokens_per_second",
                "Each labelled user's prompt-token limit (__default__: users "
                "without their own)",
                prompt_limits,
            )
        teams = self._snapshot.get("teams")
        if teams is not None:
            yield from team_metrics(teams)
        shares = self._snapshot.get("fair_shares")
        if shares is not None:
            yield from fair_share_metrics(shares)
        for key in ("store", "prompt_store", "team_store"):
            store = self._snapshot.get(key)
            if store is not None:
                yield from store_metrics(store, key + "_")


def _per_label(
    name: str, doc: str, values: dict[str, float], label: str = "user"
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def _histogram(
    name: str,
    doc: str,
    bounds: tuple[float, ...],
    labels: dict[str, dict[str, Any]],
    key: str,
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["user"])
    upper = [*map(str, bounds), "+Inf"]
    for label, values in labels.items():
        histogram = values[key]
        cumulative, buckets = 0, []
        for bound, count in zip(upper, histogram["buckets"], strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([label], buckets, histogram["sum_s"])
    return family


def fair_share_metrics(shares: dict[str, dict[str, float]]) -> Iterator[Any]:
    """Weights, virtual service and floors per labelled user (fair_share.py)."""
    gauges = {
        "weight": ("weight", "Each labelled user's weight (default 1)"),
        "virtual_service": (
            "virtual_service",
            "Weighted service counter: (output tokens + 0.5 x prompt tokens) / "
            "weight, lifted to the least-served backlogged user; the user with "
            "the lowest goes first when the engine is full",
        ),
        "floor": ("floor_tokens_per_second", "Each floored user's floor"),
    }
    for key, (name, doc) in gauges.items():
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["user"])
        for label, view in shares.items():
            if key in view:
                family.add_metric([label], view[key])
        yield family
    below = CounterMetricFamily(
        PREFIX + "below_floor_seconds",
        "Time a floored user with requests was a whole burst (100 ms of its "
        "floor) behind its floor: the floor was not kept",
        labels=["user"],
    )
    for label, view in shares.items():
        if "below_floor_seconds" in view:
            below.add_metric([label], view["below_floor_seconds"])
    yield below


def team_metrics(teams: dict[str, dict[str, float]]) -> Iterator[Any]:
    """Each configured team's tokens and limit (teams are the operator's:
    one label each)."""
    tokens = CounterMetricFamily(
        PREFIX + "team_tokens",
        "Output tokens dispatched to each team's members",
        labels=["team"],
    )
    for team, view in teams.items():
        tokens.add_metric([team], view["tokens"])
    yield tokens
    yield _per_label(
        "team_limit_tokens_per_second",
        "Each team's output-token limit",
        {team: view["limit"] for team, view in teams.items()},
        label="team",
    )


def store_metrics(store: dict[str, Any], name: str = "store_") -> Iterator[Any]:
    """The shared store's lease state of one budget (only when a store is
    configured): ``store_*`` for output tokens, ``prompt_store_*`` for
    prompt tokens, ``team_store_*`` for teams' output tokens (its "users"
    are teams)."""
    gauges = {
        "degraded": "1 while this engine serves without the store (fallback)",
        "engines_seen": "Engines sharing the store at the last round trip",
        "leases": "Users this engine holds a lease for",
        "shared_users": "Users whose limit this engine shares with other engines",
        "blocked_users": "Users with demand waiting for a share of their limit",
    }
    for key, doc in gauges.items():
        yield GaugeMetricFamily(PREFIX + name + key, doc, value=float(store[key]))
    counters = {
        "exchanges": "Store round trips that succeeded",
        "failures": "Store round trips that failed (unreachable, too slow)",
        "fallbacks": "Times this engine started serving without the store",
        "grants": "Leases granted or raised",
        "returns": "Leases lowered or given back",
    }
    for key, doc in counters.items():
        yield CounterMetricFamily(PREFIX + name + key, doc, value=store[key])
    yield CounterMetricFamily(
        PREFIX + name + "failing_seconds",
        "Seconds shared and new users waited because store rounds failed "
        "(from a failed round to the next answer or to the fallback)",
        value=store["failing_s"],
    )
    yield SummaryMetricFamily(
        PREFIX + name + "round_trip_seconds",
        "Time of a successful store round trip, seen from the engine",
        count_value=store["exchanges"],
        sum_value=store["rtt_sum_s"],
    )
    yield GaugeMetricFamily(
        PREFIX + name + "round_trip_max_seconds",
        "Longest successful store round trip so far",
        value=store["rtt_max_s"],
    )


def admission_metric(rejections: dict[tuple[str, str], int]) -> CounterMetricFamily:
    """Requests refused at admission, per user label and reason: the user's
    own caps (429) and vLLM's global caps (503)."""
    family = CounterMetricFamily(
        PREFIX + "admission_rejections",
        "Requests refused at admission: user_max_concurrent_requests and "
        "user_max_queued_prompt_tokens (HTTP 429, the user's own excess), "
        "max_num_queued_reqs and max_num_queued_tokens (HTTP 503, vLLM's "
        "global caps, which requests held back by their user's limit do not "
        "count against)",
        labels=["user", "reason"],
    )
    for (label, reason), count in sorted(rejections.items()):
        family.add_metric([label, reason], count)
    return family
