"""The scheduler's statistics, per user and per label (no vLLM import).

``OutputRateStats`` keeps the same counts twice: per **user**, for the admin
stats endpoint (``users_page``: tokens dispatched, refunds, throttled
request-steps, resident throttled requests, first tokens and their time
from arrival, prompt tokens computed while prompt rates are on; a record
lasts while the user has traffic and ``USER_RETENTION_S`` after), and per
**label**, for Prometheus (``snapshot``; labels from
``metric_labels.MetricLabels``, so their number is bounded and each label's
series only grows). The step's settling records into it (``record_step``,
``record_first_tokens``, ...) at a cost of O(users served), not O(tokens);
steps that serve the same users as the last one are summed (``_LastStep``)
and written into the counters when the users change or someone reads them.
Why and how: docs/architecture.md, "Statistics and the label bound".
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, mul
from typing import Any

from vllm_output_rate.scheduling.metric_labels import LABEL_IDLE_S, MetricLabels
from vllm_output_rate.scheduling.stat_records import (
    GAP_BUCKETS_NS,
    NS_PER_S,
    LabelStats,
    UserStats,
)

# A user's record (the admin view) is dropped this long after its last
# traffic; the check runs at most once per CHECK_RETENTION_S.
USER_RETENTION_S = 600.0
CHECK_RETENTION_S = 60.0


@dataclass
class _LastStep:
    """The latest step's users, and what the steps since the first one with
    exactly these users added that is not written into the counters yet.

    Such steps (steady decoding; speculative decoding, whose accepted drafts
    change the counts) give every one of these users one gap, the same for
    all of them, and tokens that differ only in number: a step adds its gap
    to a histogram of steps and, if its counts differ from the latest's, its
    counts to a per-user list, both in C. ``fold`` writes it all into the
    label and user counters, when the users change or someone reads them.
    Every user has at least one token in every step (``record_step`` drops
    zero counts), so a label's gaps of 0 (tokens of the same step) are its
    tokens less one per user and step.
    """

    served: dict[str, int]  # the latest step's tokens per user
    time_ns: int  # the latest step's time
    users: list[str]  # served's users, in the order of the lists below
    labels: list[LabelStats]  # the distinct labels of these users
    label_users: list[int]  # users per label
    # Each user's place in ``labels``; None: one label per user, in order.
    label_of_user: list[int] | None
    # Not written yet: tokens per user, besides ``repeats`` times ``served``.
    user_tokens: list[int]
    repeats: int = 1
    steps: int = 1  # steps whose tokens are pending
    gap_steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps
    gap_sum_ns: int = 0

    def repeat(self, now_ns: int) -> None:
        """The latest step's counts again, at ``now_ns``: O(1)."""
        self._gap(now_ns)
        self.repeats += 1

    def again(self, now_ns: int, served: Mapping[str, int]) -> None:
        """The same users with other counts, at ``now_ns``: C-level passes."""
        self._gap(now_ns)
        latest = self._counts_of(self.served)
        if self.repeats != 1:
            latest = list(map(mul, latest, repeat(self.repeats)))
        self.user_tokens = list(map(add, self.user_tokens, latest))
        self.served = dict(served)
        self.repeats = 1

    def _counts_of(self, served: Mapping[str, int]) -> list[int]:
        return list(map(served.__getitem__, self.users))

    def _gap(self, now_ns: int) -> None:
        gap_ns = now_ns - self.time_ns
        bucket = bisect.bisect_left(GAP_BUCKETS_NS, gap_ns)
        self.gap_steps[bucket] = self.gap_steps.get(bucket, 0) + 1
        self.gap_sum_ns += gap_ns
        self.steps += 1
        self.time_ns = now_ns

    def fold(self, records: dict[str, UserStats]) -> bool:
        """Write what is pending into the label counters and the users'
        ``records``; returns whether a record was created."""
        if not self.steps:
            return False
        latest = self._counts_of(self.served)
        if self.repeats:
            latest = list(map(mul, latest, repeat(self.repeats)))
        tokens = list(map(add, self.user_tokens, latest))
        created = False
        now_ns = self.time_ns
        for user, count in zip(self.users, tokens, strict=True):
            record = records.get(user)
            if record is None:
                record = records[user] = UserStats(now_ns, now_ns)
                created = True
            record.tokens_admitted += count
            # Not back in time: traffic recorded since (prompt tokens,
            # refunds) may have touched the record later than these steps.
            if record.last_active_ns < now_ns:
                record.last_active_ns = now_ns
        index = self.label_of_user
        if index is None:
            label_tokens = tokens
        else:
            label_tokens = [0] * len(self.labels)
            for place, count in zip(index, tokens, strict=True):
                label_tokens[place] += count
        steps, gap_steps, gap_sum_ns = self.steps, self.gap_steps, self.gap_sum_ns
        gap_count = sum(gap_steps.values())
        for stats, users, count in zip(
            self.labels, self.label_users, label_tokens, strict=True
        ):
            stats.tokens_admitted += count
            gaps = stats.gaps
            same_step = count - users * steps
            gaps.buckets[0] += same_step
            gaps.count += same_step + users * gap_count
            for bucket, times in gap_steps.items():
                gaps.buckets[bucket] += users * times
            gaps.sum_ns += users * gap_sum_ns
        self.user_tokens = [0] * len(self.users)
        self.repeats = self.steps = self.gap_sum_ns = 0
        self.gap_steps = {}
        return created


# At most this many users beyond the latest step's are recorded apart
# (``_record_extended``) rather than starting a new ``_LastStep``.
MAX_APART_USERS = 8


def _extends(latest: Mapping[str, int], served: Mapping[str, int]) -> bool:
    """Whether ``served`` holds every user of ``latest`` and a few more."""
    extra = len(served) - len(latest)
    return 0 < extra <= MAX_APART_USERS and latest.keys() <= served.keys()


class OutputRateStats:
    def __init__(
        self, always_labeled: Iterable[str] = (), recent_users: int = 100
    ) -> None:
        self.labels = MetricLabels(always_labeled, recent_users)
        self._labels: dict[str, LabelStats] = {}
        self._users: dict[str, UserStats] = {}
        # The users' names in order, for paging; None once a user came or went.
        self._sorted_names: list[str] | None = None
        # Each user's latest dispatch time, except the latest step's users
        # (self._last_step).
        self._last_dispatch_ns: dict[str, int] = {}
        self._last_step: _LastStep | None = None
        self._label_by_user: dict[str, str] = {}
        # Resident requests skipped for lack of budget in the last step, per
        # user, and the labels they were counted under.
        self._resident_throttled: Mapping[str, int] = {}
        self._throttled_labels: list[LabelStats] = []
        self._retention_checked_ns: int | None = None

    def label_of(self, user: str) -> str:
        return self.labels.label_of(user)

    def _stats(self, label: str) -> LabelStats:
        stats = self._labels.get(label)
        if stats is None:
            stats = self._labels[label] = LabelStats()
        return stats

    def _user(self, user: str, now_ns: int) -> UserStats:
        record = self._users.get(user)
        if record is None:
            record = self._users[user] = UserStats(now_ns, now_ns)
            self._sorted_names = None
        record.last_active_ns = now_ns
        return record

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

    # ----- recording ------------------------------------------------------

    def record_step(
        self,
        now_ns: int,
        served: Mapping[str, int],
        refunded: Mapping[str, int],
        throttled: Mapping[str, int],
    ) -> None:
        """One scheduler step: tokens dispatched, refunds and skipped requests."""
        if served:
            if 0 in served.values():  # no token, no gap (an aborted request)
                served = {user: count for user, count in served.items() if count}
            last = self._last_step
            # last.served is a plain dict: with Counters on both sides, ==
            # would run Counter's Python-level loop.
            if last is not None and last.served == served:
                last.repeat(now_ns)
            elif last is not None and last.served.keys() == served.keys():
                last.again(now_ns, served)
            elif last is not None and _extends(last.served, served):
                self._record_extended(now_ns, last, served)
            elif served:
                self._record_served(now_ns, served)
        for user, count in refunded.items():
            self._stats(self.label_of(user)).refunds += count
            self._user(user, now_ns).refunds += count
        for stats in self._throttled_labels:
            stats.resident_throttled = 0
        self._resident_throttled = throttled
        self._throttled_labels = []
        for user, count in throttled.items():
            stats = self._stats(self.label_of(user))
            stats.throttled_request_steps += count
            stats.resident_throttled += count
            self._throttled_labels.append(stats)
            self._user(user, now_ns).throttled_request_steps += count

    def record_first_tokens(
        self, now_ns: int, arrivals: Iterable[tuple[str, int]]
    ) -> None:
        """Requests whose first token the step at ``now_ns`` sampled, as
        (user, arrival time in ns) pairs, one per request."""
        for user, arrival_ns in arrivals:
            waited_ns = max(0, now_ns - arrival_ns)
            self._stats(self.label_of(user)).first_token.observe(waited_ns)
            record = self._user(user, now_ns)
            record.first_tokens += 1
            record.first_token_sum_ns += waited_ns

    def record_reclaimed(self, counts: Mapping[str, int]) -> None:
        """Resident requests preempted to give their place to users with budget."""
        for user, count in counts.items():
            self._stats(self.label_of(user)).reclaimed += count

    def record_recomputed(self, counts: Mapping[str, int]) -> None:
        """Tokens computed again for requests resuming after a preemption."""
        for user, count in counts.items():
            self._stats(self.label_of(user)).recomputed_tokens += count

    def record_prompt_tokens(self, now_ns: int, counts: Mapping[str, int]) -> None:
        """Prompt tokens computed per user in the step at ``now_ns`` (prefill
        and recomputation), as charged to the users' prompt rates. A user
        computing a prompt has traffic: its record starts or stays alive, as
        for tokens dispatched."""
        for user, count in counts.items():
            self._stats(self.label_of(user)).prompt_tokens += count
            self._user(user, now_ns).prompt_tokens += count

    def _record_extended(
        self, now_ns: int, last: _LastStep, served: Mapping[str, int]
    ) -> None:
        """The latest step's users again and a few more (a team's members
        taking turns beside a full batch): the latest step's as they were,
        the few apart, user by user."""
        core = dict(zip(last.users, map(served.__getitem__, last.users), strict=True))
        if core == last.served:
            last.repeat(now_ns)
        else:
            last.again(now_ns, core)
        extra = served.keys() - core.keys()
        names = list(served)
        apart = sorted(extra, key=names.index)  # in the step's order
        for user, label in zip(apart, self._labels_of(apart), strict=True):
            count = served[user]
            stats = self._stats(label)
            stats.tokens_admitted += count
            previous = self._last_dispatch_ns.get(user)
            if previous is not None:
                stats.gaps.observe(now_ns - previous)
            # Its other tokens in the step: gaps of 0.
            stats.gaps.buckets[0] += count - 1
            stats.gaps.count += count - 1
            self._user(user, now_ns).tokens_admitted += count
            self._last_dispatch_ns[user] = now_ns

    def _record_served(self, now_ns: int, served: Mapping[str, int]) -> None:
        """Users served in the same earlier step share one gap, so gaps are
        observed per (label, previous dispatch time), not per user."""
        self._close_last_step()
        labels = self._labels_of(served)
        previous = map(self._last_dispatch_ns.get, served)
        groups = Counter(zip(labels, previous, strict=True))
        for (label, last), users in groups.items():
            if last is not None:
                self._stats(label).gaps.observe(now_ns - last, users)
        users_per_label = Counter(labels)
        place = {label: i for i, label in enumerate(users_per_label)}
        self._last_step = _LastStep(
            served=dict(served),
            time_ns=now_ns,
            users=list(served),
            labels=list(map(self._stats, users_per_label)),
            label_users=list(users_per_label.values()),
            label_of_user=(
                None
                if len(place) == len(served)
                else list(map(place.__getitem__, labels))
            ),
            user_tokens=[0] * len(served),
        )

    def _fold_last_step(self) -> None:
        """Write the latest steps' pending counts (see ``_LastStep``)."""
        if self._last_step is not None and self._last_step.fold(self._users):
            self._sorted_names = None

    def _close_last_step(self) -> None:
        """Write the latest step's counts and dispatch time per user."""
        if self._last_step is not None:
            self._fold_last_step()
            last, self._last_step = self._last_step, None
            self._last_dispatch_ns.update(dict.fromkeys(last.served, last.time_ns))

    # ----- memory bounds ----------------------------------------------------

    def forget_users(self, keep: Iterable[str], now_ns: int) -> None:
        """Drop gap state of users not in ``keep``; release the labels of
        users idle for ``LABEL_IDLE_S``; drop records idle for
        ``USER_RETENTION_S`` (checked at most every ``CHECK_RETENTION_S``)."""
        self._close_last_step()
        kept = set(keep)
        self._last_dispatch_ns = {
            u: t for u, t in self._last_dispatch_ns.items() if u in kept
        }
        idle_labels = [
            user
            for user in self.labels.recent
            if user not in kept and self._idle_s(user, now_ns) >= LABEL_IDLE_S
        ]
        if idle_labels:
            self.labels.release(idle_labels)
            for user in idle_labels:
                self._labels.pop(user, None)  # its series ends
            # Users counted under __other__ may take the freed labels.
            self._label_by_user.clear()
        else:
            self._label_by_user = {
                u: label for u, label in self._label_by_user.items() if u in kept
            }
        checked = self._retention_checked_ns
        if checked is None or now_ns - checked >= CHECK_RETENTION_S * NS_PER_S:
            self._retention_checked_ns = now_ns
            self._sorted_names = None
            self._users = {
                user: record
                for user, record in self._users.items()
                if user in kept
                or now_ns - record.last_active_ns < USER_RETENTION_S * NS_PER_S
            }

    def _idle_s(self, user: str, now_ns: int) -> float:
        record = self._users.get(user)
        if record is None:
            return float("inf")
        return (now_ns - record.last_active_ns) / NS_PER_S

    # ----- reading ----------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Per label, for the metrics (at most the bound of MetricLabels)."""
        self._fold_last_step()
        return {label: s.snapshot() for label, s in self._labels.items()}

    def users_page(
        self, now_ns: int, limit: int, after: str | None = None
    ) -> tuple[dict[str, dict[str, Any]], str | None, int]:
        """Up to ``limit`` users' records in name order, starting after the
        name ``after``; returns them, the cursor of the next page (None at
        the end) and the number of users on record."""
        self._fold_last_step()
        if self._sorted_names is None:
            self._sorted_names = sorted(self._users)
        names = self._sorted_names
        start = 0 if after is None else bisect.bisect_right(names, after)
        page = names[start : start + limit]
        more = start + limit < len(names)
        return (
            {user: self._user_view(user, now_ns) for user in page},
            page[-1] if more and page else None,
            len(names),
        )

    def _user_view(self, user: str, now_ns: int) -> dict[str, Any]:
        record = self._users[user]
        return {
            "label": self.labels.current_label(user),
            "tokens_admitted": record.tokens_admitted,
            "refunds": record.refunds,
            "throttled_request_steps": record.throttled_request_steps,
            "resident_throttled": self._resident_throttled.get(user, 0),
            "first_tokens": record.first_tokens,
            "first_token_sum_s": record.first_token_sum_ns / NS_PER_S,
            "prompt_tokens": record.prompt_tokens,
            "idle_s": (now_ns - record.last_active_ns) / NS_PER_S,
            "tracked_s": (now_ns - record.since_ns) / NS_PER_S,
        }
