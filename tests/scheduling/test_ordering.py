"""The two ordering functions on plain records (no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from vllm_output_rate.scheduling.ordering import fair_order, rotate_within_groups


@dataclass(frozen=True)
class Req:
    name: str
    user: str
    last_served: int = -1
    priority: int = 0


def user(r: Req) -> str:
    return r.user


def served(r: Req) -> int:
    return r.last_served


def test_rotation_moves_the_least_recently_served_stream_first() -> None:
    a1, a2, a3 = Req("a1", "a", 9), Req("a2", "a", 3), Req("a3", "a", 7)
    b1 = Req("b1", "b", 1)
    order = rotate_within_groups([a1, b1, a2, a3], user, served)
    assert [r.name for r in order] == ["a2", "b1", "a3", "a1"]


def test_rotation_keeps_other_groups_in_their_places() -> None:
    reqs = [Req("b", "b"), Req("a1", "a", 5), Req("c", "c"), Req("a2", "a", 1)]
    order = rotate_within_groups(reqs, user, served)
    assert order[0].name == "b" and order[2].name == "c"
    assert [order[1].name, order[3].name] == ["a2", "a1"]


def test_fair_order_interleaves_users_least_recently_served_first() -> None:
    reqs = [Req(f"a{i}", "a", i) for i in range(3)] + [Req("b0", "b", 0)]
    order = fair_order(reqs, user, served, {"a": 10, "b": 2})
    assert [r.name for r in order] == ["b0", "a0", "a1", "a2"]


def test_fair_order_serves_a_lower_priority_value_first() -> None:
    urgent = Req("u", "a", 5, priority=0)
    later = Req("l", "b", 0, priority=1)
    order = fair_order(
        [later, urgent], user, served, {}, priority_of=lambda r: r.priority
    )
    assert [r.name for r in order] == ["u", "l"]


requests = st.lists(
    st.builds(
        Req,
        name=st.uuids().map(str),
        user=st.sampled_from("abcd"),
        last_served=st.integers(-1, 50),
        priority=st.integers(0, 2),
    ),
    max_size=30,
)


@given(requests)
def test_both_orders_are_permutations_and_leave_the_input_alone(reqs) -> None:
    before = list(reqs)
    for order in (
        rotate_within_groups(reqs, user, served),
        fair_order(reqs, user, served, {"a": 3}, priority_of=lambda r: r.priority),
    ):
        assert sorted(order, key=id) == sorted(reqs, key=id)
    assert reqs == before


@given(requests)
def test_fair_order_gives_the_first_slots_to_distinct_users(reqs) -> None:
    order = fair_order(reqs, user, served, {})
    users = {r.user for r in reqs}
    assert len({r.user for r in order[: len(users)]}) == len(users)
