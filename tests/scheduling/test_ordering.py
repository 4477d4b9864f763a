"""The ordering functions and the slot ranking on plain records (no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_output_rate.scheduling.fair_share import FairShare
from vllm_output_rate.scheduling.ordering import (
    SlotHolders,
    claim_order,
    rotate_within_groups,
    share_slots,
    weighted_shares,
)


def fair_order(*args, **kwargs) -> list:
    """The running list's order alone (no waiting requests)."""
    return share_slots(*args, **kwargs)[0]


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


def round_robin(last_served: dict[str, int]):
    """Plain turns: each user's k-th slot after everyone's (k-1)-th, the user
    served least recently first."""
    return lambda u, k, turn: (k, last_served.get(u, -1))


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
    order = fair_order(reqs, user, served, round_robin({"a": 10, "b": 2}))
    assert [r.name for r in order] == ["b0", "a0", "a1", "a2"]


def test_fair_order_hands_slots_in_proportion_to_weight() -> None:
    fair = FairShare({"a": 2})
    reqs = [Req(f"{u}{i}", u, i) for u in "ab" for i in range(6)]
    order = fair_order(reqs, user, served, lambda u, k, turn: fair.key(u, k, 0, turn))
    # a's k-th slot ranks at k/2, b's at k: two of a's for each of b's
    # (ties go to the name first in order).
    assert "".join(r.user for r in order[:6]) == "abaaba"


def test_fair_order_puts_the_least_served_user_first() -> None:
    fair = FairShare()
    fair.charge({"a": 5}, {"b": 4})  # a: 5 output tokens; b: 4 prompt (2.0)
    reqs = [Req(f"{u}{i}", u) for u in "ab" for i in range(4)]
    order = fair_order(reqs, user, served, lambda u, k, turn: fair.key(u, k, 0, turn))
    # b is owed 3 tokens: its slots rank 2, 3, 4, 5; a's 5, 6, 7, 8.
    assert "".join(r.user for r in order) == "bbbabaaa"


def test_a_user_below_its_floor_goes_before_every_counter() -> None:
    fair = FairShare({"a": 100}, floors={"f": 30})
    fair.credit_floors(0, {"f": 1, "a": 1}, {})
    fair.credit_floors(100_000_000, {"f": 1, "a": 1}, {})  # 3 tokens owed
    assert fair.credit("f") == 3
    fair.charge({"f": 1000}, {})
    reqs = [Req(f"{u}{i}", u) for u in "af" for i in range(5)]
    order = fair_order(reqs, user, served, lambda u, k, turn: fair.key(u, k, 0, turn))
    assert "".join(r.user for r in order)[:3] == "fff"


def test_share_slots_hands_free_places_to_waiting_users_by_rank() -> None:
    fair = FairShare()
    fair.charge({"a": 10, "b": 3, "c": 1}, {})
    running = [Req("a0", "a"), Req("a1", "a"), Req("b0", "b")]
    order, granted, *_ = share_slots(
        running,
        user,
        served,
        lambda u, k, turn: fair.key(u, k, 0, turn),
        waiting={"b": 2, "c": 3, "new": 1},
        slots=4,
        room=2,
    )
    # "new" has nothing running: first. Then by service: c (1) before b (3);
    # c's second slot (2) before b's running one (3); room is then used up.
    assert granted == {"new": 1, "c": 1}
    assert [r.name for r in order] == ["b0", "a0", "a1"]


def test_share_slots_leaves_requests_beyond_the_budget_last() -> None:
    fair = FairShare()
    fair.charge({"a": 1}, {})
    reqs = [Req(f"a{i}", "a") for i in range(3)] + [Req("b0", "b")]
    order, *_ = share_slots(
        reqs,
        user,
        served,
        lambda u, k, turn: fair.key(u, k, 0, turn),
        limit_of={"a": 1, "b": 1}.get,
    )
    assert [r.name for r in order] == ["b0", "a0", "a1", "a2"]


def test_weighted_shares_split_by_weight_and_give_unused_slots_away() -> None:
    weight = {"a": 2.0}.get
    shares = weighted_shares(3, {"a": 16, "b": 16}, lambda u: weight(u, 1.0))
    assert shares == {"a": 2.0, "b": 1.0}
    # b can use one slot only: the rest goes to the others by weight.
    shares = weighted_shares(6, {"a": 9, "b": 1, "c": 9}, lambda u: weight(u, 1.0))
    assert shares["b"] == 1 and shares["a"] == 2 * shares["c"]
    assert sum(shares.values()) == pytest.approx(6)
    assert weighted_shares(0, {"a": 1}, lambda u: 1.0) == {}


def test_a_request_keeps_its_slot_for_its_turn_within_its_users_share() -> None:
    """a and b are level; a's two requests and b's one ran last step, in
    their turns. a's share of 3 slots is 1.5, so both of a's turns are kept
    on (2 = ceil 1.5) and b's waiting second request does not churn them."""
    fair = FairShare()
    running = [Req("a0", "a", 7), Req("a1", "a", 7), Req("a2", "a", 2)]
    running += [Req("b0", "b", 7), Req("b1", "b", 1)]
    in_turn = {"a0": 10, "a1": 10, "b0": 10}
    user_served = {"a": 7, "b": 5}  # ties go to b
    order, *_ = share_slots(
        running,
        user,
        served,
        lambda u, k, turn: fair.key(u, k, user_served[u], turn),
        turn_left=lambda r: in_turn.get(r.name, 0),
        weight_of=fair.weight,
        slots=3,
    )
    assert {r.name for r in order[:3]} == {"a0", "a1", "b0"}
    # Without turns the slots go round: b's second request takes one of a's.
    order, *_ = share_slots(
        running,
        user,
        served,
        lambda u, k, turn: fair.key(u, k, user_served[u], turn),
        slots=3,
    )
    assert sum(r.user == "b" for r in order[:3]) == 2


def test_a_turn_never_holds_a_slot_owed_to_another_user_by_weight() -> None:
    """b weighs 2: its share of 3 slots is 2. a's second request is in its
    turn, but beyond a's share (1): b's new request takes the slot."""
    fair = FairShare(weights={"b": 2.0})
    running = [Req("a0", "a", 7), Req("a1", "a", 7), Req("b0", "b", 7)]
    running += [Req("b1", "b", -1)]
    order, *_ = share_slots(
        running,
        user,
        served,
        lambda u, k, turn: fair.key(u, k, 0, turn),
        turn_left=lambda r: 10 if r.last_served == 7 else 0,
        weight_of=fair.weight,
        slots=3,
    )
    assert {r.name for r in order[:3]} == {"a0", "b0", "b1"}


def test_fair_order_serves_a_lower_priority_value_first() -> None:
    urgent = Req("u", "a", 5, priority=0)
    later = Req("l", "b", 0, priority=1)
    order = fair_order(
        [later, urgent], user, served, round_robin({}), priority_of=lambda r: r.priority
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
        fair_order(
            reqs, user, served, round_robin({"a": 3}), priority_of=lambda r: r.priority
        ),
    ):
        assert sorted(order, key=id) == sorted(reqs, key=id)
    assert reqs == before


@given(requests)
def test_fair_order_gives_the_first_slots_to_distinct_users(reqs) -> None:
    order = fair_order(reqs, user, served, round_robin({}))
    users = {r.user for r in reqs}
    assert len({r.user for r in order[: len(users)]}) == len(users)


# ----- scarce resident slots ---------------------------------------------------


def test_claims_go_to_the_user_holding_fewest_first() -> None:
    resident = {"a": 2, "b": 0, "c": 1}
    handed = list(claim_order({"a": 2, "b": 2, "c": 1}, resident, {"b": 5, "c": 1}))
    # b holds none; c holds one and b one after its first slot, but b was
    # served more recently; a was never served, so a before b at two.
    assert handed == [("b", 0), ("c", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert resident == {"a": 4, "b": 2, "c": 2}


def test_a_slot_moves_only_from_a_surplus_or_towards_fewer() -> None:
    idle = {
        "hog": [Req("h1", "hog"), Req("h2", "hog")],
        "slow": [Req("s1", "slow")],
    }
    resident = {"hog": 3, "slow": 1}
    feeds = {"hog": 1, "slow": 2}.__getitem__
    holders = SlotHolders(idle, resident, feeds, {})
    # The hog holds more than its rate can feed: that surplus goes first.
    assert holders.take(5).name == "h1"
    assert holders.take(5).name == "h2"
    # slow holds what its rate feeds: only for a claimant holding less.
    assert holders.take(1) is None
    assert holders.take(0).name == "s1"
    assert resident == {"hog": 1, "slow": 0} and not holders


def test_among_holders_the_one_holding_most_gives_first() -> None:
    idle = {u: [Req(f"{u}{i}", u) for i in range(3)] for u in "abc"}
    resident = {"a": 3, "b": 2, "c": 3}
    holders = SlotHolders(idle, resident, lambda u: 9, {"a": 1, "c": 7})
    taken = [holders.take(0).user for _ in range(5)]
    # c and a hold most, c was served more recently; re-ranked after each.
    assert taken == ["c", "a", "c", "a", "b"]


def test_a_better_priority_is_never_taken_for_a_worse_one() -> None:
    idle = {"hog": [Req("urgent", "hog", priority=0), Req("bulk", "hog", priority=3)]}
    holders = SlotHolders(
        idle, {"hog": 2}, lambda u: 0, {}, priority_of=lambda r: r.priority
    )
    assert holders.take(0, min_priority=5) is None
    assert holders.take(0, min_priority=2).name == "bulk"
    assert holders.take(0, min_priority=0).name == "urgent"


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 6), min_size=1),
    st.integers(0, 6),
)
def test_taking_never_leaves_a_holder_below_the_claimant_or_its_feed(
    counts, claimant
) -> None:
    idle = {u: [Req(f"{u}{i}", u) for i in range(n)] for u, n in counts.items()}
    resident = dict(counts)
    holders = SlotHolders(idle, resident, lambda u: 2, {})
    while (taken := holders.take(claimant)) is not None:
        left = resident[taken.user]
        # Before the take it held more than the claimant or than its feed.
        assert left + 1 > claimant or left + 1 > 2
    assert all(n <= max(claimant, 2) for n in resident.values())
