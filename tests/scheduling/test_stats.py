"""Per-user statistics: the grouped per-step update against a plain one."""

from __future__ import annotations

import bisect
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.scheduling.stats import (
    _GAP_BUCKETS_NS,
    GAP_BUCKETS_S,
    OTHER_USERS,
    OutputRateStats,
)

NAMED = ("alice", "bob")
USERS = st.sampled_from(["alice", "bob", "carol", "dave", ANONYMOUS_USER])


def reference(steps: list[tuple[int, Counter[str]]]) -> dict[str, dict]:
    """Token by token, user by user: what the metrics mean."""

    def label(user: str) -> str:
        return user if user in NAMED or user == ANONYMOUS_USER else OTHER_USERS

    out: dict[str, dict] = {}
    last: dict[str, int] = {}
    for now, served in steps:
        for user, count in served.items():
            s = out.setdefault(
                label(user),
                {"tokens": 0, "buckets": [0] * (len(GAP_BUCKETS_S) + 1), "gaps": []},
            )
            s["tokens"] += count
            gaps = ([now - last[user]] if user in last else []) + [0] * (count - 1)
            for gap in gaps:
                s["buckets"][bisect.bisect_left(_GAP_BUCKETS_NS, gap)] += 1
                s["gaps"].append(gap)
            last[user] = now
    return out


SERVED = st.dictionaries(USERS, st.integers(1, 4), max_size=5)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3_000_000_000),
            # None: serve what the previous step served (steady decoding).
            st.one_of(st.none(), SERVED),
        ),
        max_size=30,
    )
)
def test_grouped_update_equals_a_per_user_count(
    raw: list[tuple[int, dict[str, int] | None]],
) -> None:
    steps: list[tuple[int, Counter[str]]] = []
    now = 0
    for advance, served in raw:
        now += advance
        if served is None:
            served = steps[-1][1] if steps else {}
        steps.append((now, Counter(served)))
    stats = OutputRateStats(NAMED)
    for now, served in steps:
        stats.record_step(now, served, Counter(), Counter())
    snapshot = stats.snapshot()
    expected = reference(steps)
    assert set(snapshot) == set(expected)
    for label, want in expected.items():
        got = snapshot[label]
        assert got["tokens_admitted"] == want["tokens"]
        assert got["gap_buckets"] == want["buckets"]
        assert got["gap_count"] == len(want["gaps"])
        assert got["gap_sum_s"] == sum(want["gaps"]) / 1e9


def test_renaming_users_moves_them_to_their_own_label() -> None:
    stats = OutputRateStats(NAMED)
    stats.record_step(1, Counter({"carol": 1}), Counter(), Counter())
    stats.set_named_users([*NAMED, "carol"])
    stats.record_step(2, Counter({"carol": 1}), Counter(), Counter())
    snapshot = stats.snapshot()
    assert snapshot[OTHER_USERS]["tokens_admitted"] == 1
    assert snapshot["carol"]["tokens_admitted"] == 1


def test_forgetting_users_keeps_the_gaps_of_the_others() -> None:
    stats = OutputRateStats(NAMED)
    for now in (10, 20, 30):  # the same step three times: repeated updates
        stats.record_step(now, Counter({"alice": 1, "carol": 1}), Counter(), Counter())
    stats.forget_users(["alice"])
    stats.record_step(45, Counter({"alice": 1, "carol": 1}), Counter(), Counter())
    snapshot = stats.snapshot()
    # alice: gaps 10, 10, 15; carol: 10, 10, then forgotten (no gap).
    assert snapshot["alice"]["gap_count"] == 3
    assert snapshot["alice"]["gap_sum_s"] == 35 / 1e9
    assert snapshot[OTHER_USERS]["gap_count"] == 2
    assert snapshot[OTHER_USERS]["tokens_admitted"] == 4
