"""Per-user counters kept by the scheduler (no vLLM import).

Label cardinality stays bounded: users named in the configuration keep their
own label, requests without a user are ``__anonymous__``, and every other
user is counted under ``__other__``, so a million distinct names cannot blow
up the metrics. Updates cost O(users served in the step), not O(tokens), and
the per-user part runs in C (``map``/``Counter``). A step that serves exactly
what the previous one served (steady decoding) costs O(labels): it repeats
that step's per-label update with one new gap.
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
    reclaimed: int = 0  # resident requests preempted for users with budget
    recomputed_tokens: int = 0  # computed again after any preemption
    gap_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(GAP_BUCKETS_S) + 1)
    )
    gap_sum_ns: int = 0
    gap_count: int = 0

    def observe_gap(self, gap_ns: int, times: int = 1) -> None:
        self.gap_buckets[bisect.bisect_left(_GAP_BUCKETS_NS, gap_ns)] += times
        self.gap_sum_ns += gap_ns * times
        self.gap_count += times


@dataclass
class _LastStep:
    """The latest step's tokens per user, and what they added per label.

    Its users' dispatch time is kept here rather than per user: a next step
    that serves exactly the same counts adds the same per label, with one gap
    (from this step to that one) per user.
    """

    served: dict[str, int]
    time_ns: int
    per_label: list[tuple[LabelStats, int, int]]  # (stats, users, tokens)

    def count_tokens(self) -> None:
        """Add the step's tokens to each label's counters."""
        for stats, users, tokens in self.per_label:
            stats.tokens_admitted += tokens
            if tokens > users:
                stats.observe_gap(0, tokens - users)  # same step: gap 0

    def repeat(self, now_ns: int) -> None:
        """The same tokens again at ``now_ns``: one gap per user since then."""
        gap_ns = now_ns - self.time_ns
        for stats, users, _ in self.per_label:
            stats.observe_gap(gap_ns, users)
        self.count_tokens()
        self.time_ns = now_ns


class OutputRateStats:
    def __init__(self, named_users: Iterable[str]) -> None:
        self._named = set(named_users)
        self._labels: dict[str, LabelStats] = {}
        # Each user's latest dispatch time, except the latest step's users
        # (self._last_step).
        self._last_dispatch_ns: dict[str, int] = {}
        self._last_step: _LastStep | None = None
        self._label_by_user: dict[str, str] = {}
        self._any_resident_throttled = False

    def set_named_users(self, named_users: Iterable[str]) -> None:
        self._close_last_step()  # its per-label update uses the old labels
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
        try:
            return list(map(cache.__getitem__, users))
        except KeyError:  # a user not seen before
            for user in users:
                if user not in cache:
                    cache[user] = self.label_of(user)
            return list(map(cache.__getitem__, users))

    def record_step(
        self,
        now_ns: int,
        served: Mapping[str, int],
        refunded: Mapping[str, int],
        throttled: Mapping[str, int],
    ) -> None:
        """One scheduler step: tokens dispatched, refunds and skipped requests."""
        if served:
            last = self._last_step
            # last.served is a plain dict: with Counters on both sides, ==
            # would run Counter's Python-level loop.
            if last is not None and last.served == served:
                last.repeat(now_ns)
            else:
                self._record_served(now_ns, served)
        for user, count in refunded.items():
            self._stats(self.label_of(user)).refunds += count
        if self._any_resident_throttled:
            for stats in self._labels.values():
                stats.resident_throttled = 0
        self._any_resident_throttled = bool(throttled)
        for user, count in throttled.items():
            stats = self._stats(self.label_of(user))
            stats.throttled_request_steps += count
            stats.resident_throttled += count

    def record_reclaimed(self, counts: Mapping[str, int]) -> None:
        """Resident requests preempted to give their place to users with budget."""
        for user, count in counts.items():
            self._stats(self.label_of(user)).reclaimed += count

    def record_recomputed(self, counts: Mapping[str, int]) -> None:
        """Tokens computed again for requests resuming after a preemption."""
        for user, count in counts.items():
            self._stats(self.label_of(user)).recomputed_tokens += count

    def _record_served(self, now_ns: int, served: Mapping[str, int]) -> None:
        """Users served in the same earlier step share one gap, so gaps are
        observed per (label, previous dispatch time), not per user."""
        self._close_last_step()
        labels = self._labels_of(served)
        previous = map(self._last_dispatch_ns.get, served)
        groups = Counter(zip(labels, previous, strict=True))
        for (label, last), users in groups.items():
            if last is not None:
                self._stats(label).observe_gap(now_ns - last, users)
        users_per_label = Counter(labels)
        tokens_per_label = users_per_label
        if sum(served.values()) != len(served):  # someone got several tokens
            tokens_per_label = Counter()
            for label, count in zip(labels, served.values(), strict=True):
                tokens_per_label[label] += count
        per_label = [
            (self._stats(label), users_per_label[label], tokens)
            for label, tokens in tokens_per_label.items()
        ]
        self._last_step = _LastStep(dict(served), now_ns, per_label)
        self._last_step.count_tokens()

    def _close_last_step(self) -> None:
        """Write the latest step's dispatch time per user."""
        if self._last_step is not None:
            last, self._last_step = self._last_step, None
            self._last_dispatch_ns.update(dict.fromkeys(last.served, last.time_ns))

    def forget_users(self, keep: Iterable[str]) -> None:
        """Drop per-user gap state of users not in ``keep`` (memory bound)."""
        self._close_last_step()
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
                "reclaimed": s.reclaimed,
                "recomputed_tokens": s.recomputed_tokens,
                "gap_buckets": list(s.gap_buckets),
                "gap_sum_s": s.gap_sum_ns / 1e9,
                "gap_count": s.gap_count,
            }
            for label, s in self._labels.items()
        }
