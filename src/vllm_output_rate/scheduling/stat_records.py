"""What the scheduler's statistics count, per label and per user (no vLLM import).

``LabelStats`` holds one metrics label's counters and histograms (the
Prometheus side), ``UserStats`` one user's record (the admin side);
``Histogram`` counts integer nanoseconds into fixed buckets, cumulative per
bucket. ``stats.OutputRateStats`` keeps and updates them; the bucket bounds
in seconds are also the metric families' (``integration/metrics.py``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

NS_PER_S = 1_000_000_000
# Upper bounds (seconds) of the histogram of gaps between a user's
# consecutive dispatched tokens; +Inf is implied.
GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Upper bounds (seconds) of the time from a request's arrival in the
# scheduler to the step that samples its first token.
FIRST_TOKEN_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
GAP_BUCKETS_NS = [round(b * NS_PER_S) for b in GAP_BUCKETS_S]
FIRST_TOKEN_BUCKETS_NS = [round(b * NS_PER_S) for b in FIRST_TOKEN_BUCKETS_S]


class Histogram:
    """Cumulative counts per bucket, their sum and count (integer ns)."""

    __slots__ = ("bounds_ns", "buckets", "count", "sum_ns")

    def __init__(self, bounds_ns: list[int]) -> None:
        self.bounds_ns = bounds_ns
        self.buckets = [0] * (len(bounds_ns) + 1)  # the last one is +Inf
        self.sum_ns = 0
        self.count = 0

    def observe(self, value_ns: int, times: int = 1) -> None:
        self.buckets[bisect.bisect_left(self.bounds_ns, value_ns)] += times
        self.sum_ns += value_ns * times
        self.count += times

    def snapshot(self) -> dict[str, Any]:
        return {
            "buckets": list(self.buckets),
            "sum_s": self.sum_ns / NS_PER_S,
            "count": self.count,
        }


@dataclass
class LabelStats:
    tokens_admitted: int = 0
    refunds: int = 0
    throttled_request_steps: int = 0
    resident_throttled: int = 0
    reclaimed: int = 0  # resident requests preempted for users with budget
    recomputed_tokens: int = 0  # computed again after any preemption
    # Prompt tokens computed (prefill and recomputation; prefix-cache hits
    # are not computed), counted only while prompt rates are on.
    prompt_tokens: int = 0
    gaps: Histogram = field(default_factory=lambda: Histogram(GAP_BUCKETS_NS))
    first_token: Histogram = field(
        default_factory=lambda: Histogram(FIRST_TOKEN_BUCKETS_NS)
    )

    def snapshot(self) -> dict[str, Any]:
        return {
            "tokens_admitted": self.tokens_admitted,
            "refunds": self.refunds,
            "throttled_request_steps": self.throttled_request_steps,
            "resident_throttled": self.resident_throttled,
            "reclaimed": self.reclaimed,
            "recomputed_tokens": self.recomputed_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_gap": self.gaps.snapshot(),
            "first_token": self.first_token.snapshot(),
        }


@dataclass(slots=True)
class UserStats:
    """One user's counts since ``since_ns`` (its first traffic on record)."""

    since_ns: int
    last_active_ns: int
    tokens_admitted: int = 0
    refunds: int = 0
    throttled_request_steps: int = 0
    first_tokens: int = 0
    first_token_sum_ns: int = 0
    prompt_tokens: int = 0  # as LabelStats.prompt_tokens
