"""Per-user counters kept by the scheduler (no vLLM import).

Label cardinality stays bounded: users named in the configuration keep their
own label, requests without a user are ``__anonymous__``, and every other
user is counted under ``__other__``, so a million distinct names cannot blow
up the metrics. Updates cost O(users served in the step), not O(tokens), and
the per-user part runs in C (``map``/``Counter``).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.config import ANONYMOUS_USER

OTHER_USERS = "__other__"
# Upper bounds (seconds) of the histogram of gaps between a user's
# consecutive dispatched tokens; +Inf is implied.
GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_GAP_BUCKETS_NS = [round(b * 1e9) for b in GAP_BUCKETS_S]


@dataclass
class LabelStats:
    tokens_admitted: int = 0
    refunds: int = 0
    throttled_request_steps: int = 0
    resident_throttled: int = 0
    gap_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(GAP_BUCKETS_S) + 1)
    )
    gap_sum_ns: int = 0
    gap_count: int = 0

    def observe_gap(self, gap_ns: int, times: int = 1) -> None:
        self.gap_buckets[bisect.bisect_left(_GAP_BUCKETS_NS, gap_ns)] += times
        self.gap_sum_ns += gap_ns * times
        self.gap_count += times


class OutputRateStats:
    def __init__(self, named_users: Iterable[str]) -> None:
        self._named = set(named_users)
        self._labels: dict[str, LabelStats] = {}
        self._last_dispatch_ns: dict[str, int] = {}
        self._label_by_user: dict[str, str] = {}

    def set_named_users(self, named_users: Iterable[str]) -> None:
        self._named = set(named_users)
        self._label_by_user.clear()

    def label_of(self, user: str) -> str:
        if user in self._named or user == ANONYMOUS_USER:
            return user
        return OTHER_USERS

    def _stats(self, label: str) -> LabelStats:
        stats = self._labels.get(label)
        if stats is None:
            stats = self._labels[label] = LabelStats()
        return stats

    def _labels_of(self, users: Iterable[str]) -> list[str]:
        # Cached, so that a step with hundreds of users costs C-level map()
        # calls rather than a Python call per user.
        cache = self._label_by_user
        labels = list(map(cache.get, users))
        if None in labels:
            for user in users:
                if user not in cache:
                    cache[user] = self.label_of(user)
            labels = list(map(cache.__getitem__, users))
        return labels

    def record_step(
        self,
        now_ns: int,
        served: Counter[str],
        refunded: Mapping[str, int],
        throttled: Mapping[str, int],
    ) -> None:
        """One scheduler step: tokens dispatched, refunds and skipped requests.

        Users served in the same earlier step share one gap, so gaps are
        observed per (label, previous dispatch time), not per user.
        """
        if served:
            labels = self._labels_of(served)
            previous = map(self._last_dispatch_ns.get, served)
            groups = Counter(zip(labels, previous, strict=True))
            for (label, last), users in groups.items():
                if last is not None:
                    self._stats(label).observe_gap(now_ns - last, users)
            users_per_label = Counter(labels)
            tokens_per_label = users_per_label
            if served.total() != len(served):  # someone got several tokens
                tokens_per_label = Counter()
                for label, count in zip(labels, served.values(), strict=True):
                    tokens_per_label[label] += count
            for label, tokens in tokens_per_label.items():
                stats = self._stats(label)
                stats.tokens_admitted += tokens
                if tokens > users_per_label[label]:
                    # Tokens dispatched in the same step: gap 0.
                    stats.observe_gap(0, tokens - users_per_label[label])
            self._last_dispatch_ns.update(dict.fromkeys(served, now_ns))
        for user, count in refunded.items():
            self._stats(self.label_of(user)).refunds += count
        for stats in self._labels.values():
            stats.resident_throttled = 0
        for user, count in throttled.items():
            stats = self._stats(self.label_of(user))
            stats.throttled_request_steps += count
            stats.resident_throttled += count

    def forget_users(self, keep: Iterable[str]) -> None:
        """Drop per-user gap state of users not in ``keep`` (memory bound)."""
        kept = set(keep)
        self._last_dispatch_ns = {
            u: t for u, t in self._last_dispatch_ns.items() if u in kept
        }
        self._label_by_user = {
            u: label for u, label in self._label_by_user.items() if u in kept
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            label: {
                "tokens_admitted": s.tokens_admitted,
                "refunds": s.refunds,
                "throttled_request_steps": s.throttled_request_steps,
                "resident_throttled": s.resident_throttled,
                "gap_buckets": list(s.gap_buckets),
                "gap_sum_s": s.gap_sum_ns / 1e9,
                "gap_count": s.gap_count,
            }
            for label, s in self._labels.items()
        }
