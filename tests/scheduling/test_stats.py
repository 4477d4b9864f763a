"""Statistics: the grouped per-step update against a plain per-user count,
bounded metrics labels, paging through every user, memory bounds."""

from __future__ import annotations

import bisect
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.scheduling.metric_labels import LABEL_IDLE_S, OTHER_USERS
from vllm_output_rate.scheduling.stat_records import (
    GAP_BUCKETS_NS,
    GAP_BUCKETS_S,
    NS_PER_S,
)
from vllm_output_rate.scheduling.stats import (
    CHECK_RETENTION_S,
    USER_RETENTION_S,
    OutputRateStats,
)

NAMED = ("alice", "bob")
USERS = st.sampled_from(["alice", "bob", "carol", "dave", "erin", ANONYMOUS_USER])
NOTHING: Counter[str] = Counter()


def reference(
    steps: list[tuple[int, Counter[str]]], recent_users: int
) -> tuple[dict[str, dict], Counter[str], dict[str, int], dict[str, int]]:
    """Token by token, user by user: what the metrics mean (and each user's
    first and last step served). Users outside
    NAMED take one of ``recent_users`` labels when first seen, if any is left."""
    recent: list[str] = []

    def label(user: str) -> str:
        if user in NAMED or user == ANONYMOUS_USER or user in recent:
            return user
        if len(recent) < recent_users:
            recent.append(user)
            return user
        return OTHER_USERS

    out: dict[str, dict] = {}
    per_user: Counter[str] = Counter()
    last: dict[str, int] = {}
    first: dict[str, int] = {}  # the first step that served each user
    for now, served in steps:
        first.update({user: now for user in served if user not in first})
        for user, count in served.items():
            s = out.setdefault(
                label(user),
                {"tokens": 0, "buckets": [0] * (len(GAP_BUCKETS_S) + 1), "gaps": []},
            )
            s["tokens"] += count
            per_user[user] += count
            gaps = ([now - last[user]] if user in last else []) + [0] * (count - 1)
            for gap in gaps:
                s["buckets"][bisect.bisect_left(GAP_BUCKETS_NS, gap)] += 1
                s["gaps"].append(gap)
            last[user] = now
    return out, per_user, first, last


SERVED = st.dictionaries(USERS, st.integers(1, 4), max_size=5)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3_000_000_000),
            # None: serve what the previous step served (steady decoding);
            # a list: the previous step's users with these counts
            # (speculative decoding); a tuple: the previous step's users and
            # these (a team's members taking turns beside a full batch).
            st.one_of(
                st.none(),
                SERVED,
                st.lists(st.integers(1, 4), min_size=5, max_size=5),
                st.tuples(SERVED),
            ),
        ),
        max_size=30,
    ),
    st.integers(0, 3),
    st.integers(1, 10),
)
def test_grouped_update_equals_a_per_user_count(
    raw: list[tuple[int, dict[str, int] | list[int] | tuple[dict] | None]],
    recent_users: int,
    read_every: int,
) -> None:
    steps: list[tuple[int, Counter[str]]] = []
    now = 0
    for advance, served in raw:
        now += advance
        previous = steps[-1][1] if steps else Counter()
        if served is None:
            served = previous
        elif isinstance(served, list):
            served = dict(zip(previous, served, strict=False))
        elif isinstance(served, tuple):
            served = {**previous, **served[0]}
        steps.append((now, Counter(served)))
    stats = OutputRateStats(NAMED, recent_users)
    for i, (now, served) in enumerate(steps):
        stats.record_step(now, served, NOTHING, NOTHING)
        if i % read_every == 0:  # reading in between changes nothing
            stats.users_page(now, 100)
    snapshot = stats.snapshot()
    expected, per_user, first, last = reference(steps, recent_users)
    assert set(snapshot) == set(expected)
    for label, want in expected.items():
        got = snapshot[label]
        assert got["tokens_admitted"] == want["tokens"]
        assert got["token_gap"]["buckets"] == want["buckets"]
        assert got["token_gap"]["count"] == len(want["gaps"])
        assert got["token_gap"]["sum_s"] == sum(want["gaps"]) / 1e9
    users, _, total = stats.users_page(now, 100)
    assert total == len(per_user)
    assert {user: view["tokens_admitted"] for user, view in users.items()} == per_user
    for user, view in users.items():
        assert view["idle_s"] == (now - last[user]) / NS_PER_S
        # On record from a step that served it, at the latest its last.
        assert view["idle_s"] <= view["tracked_s"] <= (now - first[user]) / NS_PER_S


def test_a_record_made_later_keeps_the_time_of_the_users_first_tokens() -> None:
    """A refund makes the record of a user whose tokens are not written
    yet: it is on record from its first tokens, active at its latest."""
    stats = OutputRateStats(NAMED)
    stats.record_step(1 * NS_PER_S, {"carol": 1}, NOTHING, NOTHING)
    stats.record_step(2 * NS_PER_S, {"dave": 1}, NOTHING, NOTHING)  # carol's folded
    stats.record_step(3 * NS_PER_S, {"erin": 1}, Counter(carol=1), NOTHING)
    users, _, _ = stats.users_page(4 * NS_PER_S, 10)
    assert users["carol"]["tracked_s"] == 3.0
    assert users["carol"]["idle_s"] == 1.0  # the refund is traffic
    assert users["carol"]["tokens_admitted"] == 1
    assert users["carol"]["refunds"] == 1


def test_labels_stay_bounded_whatever_the_number_of_users() -> None:
    stats = OutputRateStats(["vip"], recent_users=3)
    for i in range(1000):
        stats.record_step(i, Counter({f"user-{i}": 1, "vip": 1}), NOTHING, NOTHING)
    snapshot = stats.snapshot()
    # The listed user, the first three with traffic, everyone else in one.
    assert set(snapshot) == {"vip", "user-0", "user-1", "user-2", OTHER_USERS}
    assert snapshot[OTHER_USERS]["tokens_admitted"] == 997
    # The admin view still has every user.
    assert stats.users_page(1000, 10_000)[2] == 1001


def test_an_idle_users_label_goes_to_a_newcomer_and_no_series_shrinks() -> None:
    stats = OutputRateStats((), recent_users=1)
    s = NS_PER_S
    stats.record_step(0, Counter({"old": 5}), NOTHING, NOTHING)
    stats.record_step(1 * s, Counter({"new": 2}), NOTHING, NOTHING)  # no slot left
    assert stats.snapshot()[OTHER_USERS]["tokens_admitted"] == 2
    stats.forget_users([], 10 * s)
    assert "old" in stats.snapshot()  # idle, but not for long enough
    idle = round(LABEL_IDLE_S * s)
    stats.forget_users([], idle + 1)
    assert "old" not in stats.snapshot()  # its series ends
    stats.record_step(idle + 2, Counter({"new": 3}), NOTHING, NOTHING)
    snapshot = stats.snapshot()
    assert snapshot["new"]["tokens_admitted"] == 3  # a fresh series
    assert snapshot[OTHER_USERS]["tokens_admitted"] == 2  # kept, never moved
    users, _, _ = stats.users_page(idle + 2, 10)
    assert users["new"]["tokens_admitted"] == 5  # the user's own total
    assert users["new"]["label"] == "new" and users["old"]["label"] == OTHER_USERS


def test_a_busy_users_label_is_never_taken() -> None:
    stats = OutputRateStats((), recent_users=1)
    later = round(LABEL_IDLE_S * NS_PER_S) * 2
    stats.record_step(0, Counter({"busy": 1}), NOTHING, NOTHING)
    stats.forget_users(["busy"], later)  # still has requests in the engine
    stats.record_step(later, Counter({"newcomer": 1}), NOTHING, NOTHING)
    assert set(stats.snapshot()) == {"busy", OTHER_USERS}


def test_records_of_long_idle_users_are_dropped() -> None:
    stats = OutputRateStats((), recent_users=0)
    stats.record_step(0, Counter({"gone": 1, "stays": 1}), NOTHING, NOTHING)
    retention = round(USER_RETENTION_S * NS_PER_S)
    stats.record_step(retention, Counter({"stays": 1}), NOTHING, NOTHING)
    stats.forget_users([], retention + 1)
    assert set(stats.users_page(retention + 1, 10)[0]) == {"stays"}
    stats.forget_users(["stays"], 3 * retention)  # kept while it has requests
    assert set(stats.users_page(0, 10)[0]) == {"stays"}
    stats.forget_users([], 3 * retention + round(CHECK_RETENTION_S * NS_PER_S))
    assert stats.users_page(0, 10)[2] == 0


def test_pages_cover_every_user_once_in_name_order() -> None:
    stats = OutputRateStats((), recent_users=0)
    names = [f"u{i:03d}" for i in range(25)]
    stats.record_step(1, Counter(dict.fromkeys(names, 1)), NOTHING, NOTHING)
    seen: list[str] = []
    after = None
    while True:
        page, after, total = stats.users_page(2, 7, after)
        seen += list(page)
        assert total == 25
        if after is None:
            break
    assert seen == names
    assert stats.users_page(2, 7, "u024")[0] == {}
    assert list(stats.users_page(2, 2, "a")[0]) == ["u000", "u001"]


def test_throttling_refunds_and_first_tokens_per_user_and_label() -> None:
    stats = OutputRateStats(["alice"], recent_users=0)
    s = NS_PER_S
    stats.record_step(s, NOTHING, Counter({"alice": 1}), Counter({"alice": 2, "x": 1}))
    stats.record_first_tokens(s, [("alice", 0), ("alice", s // 2), ("x", s)])
    stats.record_step(2 * s, Counter({"x": 1}), NOTHING, NOTHING)
    snapshot = stats.snapshot()
    assert snapshot["alice"]["refunds"] == 1
    assert snapshot["alice"]["throttled_request_steps"] == 2
    assert snapshot["alice"]["resident_throttled"] == 0  # not in the last step
    assert snapshot["alice"]["first_token"]["count"] == 2
    assert snapshot["alice"]["first_token"]["sum_s"] == 1.5
    assert snapshot[OTHER_USERS]["first_token"]["sum_s"] == 0
    users, _, _ = stats.users_page(2 * s, 10)
    assert users["alice"]["first_tokens"] == 2
    assert users["alice"]["first_token_sum_s"] == 1.5
    assert users["alice"]["throttled_request_steps"] == 2
    assert users["x"]["tokens_admitted"] == 1
    stats.record_step(3 * s, NOTHING, NOTHING, Counter({"alice": 3}))
    assert stats.users_page(3 * s, 10)[0]["alice"]["resident_throttled"] == 3
    assert stats.snapshot()["alice"]["resident_throttled"] == 3


def test_prompt_tokens_per_user_and_label_and_they_keep_records_alive() -> None:
    stats = OutputRateStats(["alice"], recent_users=0)
    retention = round(USER_RETENTION_S * NS_PER_S)
    stats.record_step(0, Counter({"alice": 1, "bob": 1}), NOTHING, NOTHING)
    # Prompt work only: x gets a record like a served user, bob stays.
    stats.record_prompt_tokens(retention, Counter({"alice": 100, "x": 30, "bob": 5}))
    stats.record_prompt_tokens(retention, Counter({"alice": 20}))
    snapshot = stats.snapshot()
    assert snapshot["alice"]["prompt_tokens"] == 120
    assert snapshot[OTHER_USERS]["prompt_tokens"] == 35
    assert snapshot[OTHER_USERS]["tokens_admitted"] == 1  # bob's output only
    stats.forget_users([], retention + 1)
    users, _, total = stats.users_page(retention + 1, 10)
    assert total == 3
    assert users["alice"]["prompt_tokens"] == 120
    assert users["x"]["prompt_tokens"] == 30 and users["x"]["tokens_admitted"] == 0
    assert users["bob"]["prompt_tokens"] == 5 and users["bob"]["idle_s"] == 1e-9


def test_forgetting_users_keeps_the_gaps_of_the_others() -> None:
    stats = OutputRateStats(NAMED, recent_users=0)
    for now in (10, 20, 30):  # the same step three times: repeated updates
        stats.record_step(now, Counter({"alice": 1, "carol": 1}), NOTHING, NOTHING)
    stats.forget_users(["alice"], 30)
    stats.record_step(45, Counter({"alice": 1, "carol": 1}), NOTHING, NOTHING)
    snapshot = stats.snapshot()
    # alice: gaps 10, 10, 15; carol: 10, 10, then forgotten (no gap).
    assert snapshot["alice"]["token_gap"]["count"] == 3
    assert snapshot["alice"]["token_gap"]["sum_s"] == 35 / 1e9
    assert snapshot[OTHER_USERS]["token_gap"]["count"] == 2
    assert snapshot[OTHER_USERS]["tokens_admitted"] == 4
