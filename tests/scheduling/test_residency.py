"""The residency accounts on plain records (no scheduler): who claims, who may
take a slot or prefill ahead, when the scan closes, and the recompute count."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_output_rate.scheduling.demand import LAST_SERVED_ATTR, USER_ATTR
from vllm_output_rate.scheduling.residency import CONTENTION_HOLD_NS, Residency

S = 1_000_000_000


def req(rid: str, user: str, *, served: int = -1, outputs: int = 1, computed: int = 0):
    return SimpleNamespace(
        request_id=rid,
        num_output_tokens=outputs,
        num_computed_tokens=computed,
        num_tokens=computed + 1,
        priority=0,
        **{USER_ATTR: user, LAST_SERVED_ATTR: served},
    )


def feeds_two(user: str) -> int:
    return 2


def reclaim(residency, slots, running, preempt, blocks_missing=lambda: 0):
    return residency.reclaim(
        slots,
        running,
        feeds=feeds_two,
        user_last_served={},
        blocks_missing=blocks_missing,
        preempt=preempt,
    )


def test_claims_count_waiting_requests_up_to_spare_budget() -> None:
    running = [req("h1", "hog"), req("h2", "hog"), req("l1", "light")]
    unfinished = {"hog": 10, "light": 4, "idle": 2}
    reserved = {"hog": 1, "light": 3, "idle": 0}
    slots = Residency().plan(0, running, unfinished, reserved, feeds_two, 4)
    # light: 3 waiting, budget for 2 beyond its resident one; hog none spare.
    assert slots.wanted == {"light": 2}
    assert (slots.outstanding, slots.free) == (2, 1)
    assert slots.claimant_without_residents() is False
    # Slots freed for claimants are theirs; a claimant may always try.
    assert slots.may_take_a_slot("light") and not slots.may_take_a_slot("hog")
    assert not slots.may_prefill_ahead("idle")
    slots.admitted("light")
    slots.admitted("light")
    assert slots.outstanding == 0 and slots.free == -1
    assert not slots.may_take_a_slot("hog")  # no slot left over
    # With the claims met, prefill ahead is up to what a rate feeds, since
    # light claimed: the hog holds 2 already, idle nothing.
    assert slots.may_prefill_ahead("idle") and not slots.may_prefill_ahead("hog")


def test_prefill_ahead_is_capped_only_while_others_claim() -> None:
    residency = Residency()
    running = [req("h1", "hog"), req("h2", "hog")]
    alone = residency.plan(0, running, {"hog": 9}, {"hog": 0}, feeds_two, 8)
    assert alone.may_prefill_ahead("hog")  # nobody else: no cap
    # Another user claims (and gets its slot): the hog is capped for a while.
    both = residency.plan(
        S, running, {"hog": 9, "light": 1}, {"hog": 0, "light": 1}, feeds_two, 8
    )
    both.admitted("light")
    assert not both.may_prefill_ahead("hog")  # holds 2 = what 5 tok/s feeds
    later = residency.plan(
        S + CONTENTION_HOLD_NS - 1, running, {"hog": 9}, {"hog": 0}, feeds_two, 8
    )
    assert not later.may_prefill_ahead("hog")
    assert not residency.scan_needed(later, {"hog": 9}, ())  # the scan closes
    after = residency.plan(
        S + CONTENTION_HOLD_NS + 1, running, {"hog": 9}, {"hog": 0}, feeds_two, 8
    )
    assert after.may_prefill_ahead("hog")
    assert residency.scan_needed(after, {"hog": 9}, ())


def test_a_fruitless_scan_is_not_repeated_until_something_changes() -> None:
    residency = Residency()
    running = [req("h1", "hog")]
    unfinished, reserved = {"hog": 5}, {"hog": 0}

    def step(state: tuple, admitted: bool = False) -> bool:
        slots = residency.plan(0, running, unfinished, reserved, feeds_two, 8)
        needed = residency.scan_needed(slots, unfinished, state)
        if needed and admitted:
            slots.admitted("hog")
        residency.scanned(slots)
        return needed

    assert step((10, 1, 50))  # first time: scan (it admits nothing)
    assert not step((10, 1, 50))  # the same state: closed
    assert step((11, 1, 50))  # a request arrived: scan again
    assert not step((11, 1, 50))
    assert step((11, 1, 60), admitted=True)  # KV freed; this one admits
    assert step((11, 1, 60))  # after an admission, scan again
    # A claim (budget beyond the resident requests) always opens the scan.
    reserved["hog"] = 2
    assert step((11, 1, 60)) and step((11, 1, 60))


def test_a_users_own_claims_do_not_cap_it() -> None:
    residency = Residency()
    running = [req("a1", "a")]
    residency.plan(0, running, {"a": 5}, {"a": 2}, feeds_two, 8)
    slots = residency.plan(1, running * 2, {"a": 5}, {"a": 0}, feeds_two, 8)
    assert slots.may_prefill_ahead("a")


def test_reclaim_takes_the_surplus_and_protects_the_victim() -> None:
    residency = Residency()
    hog = [req(f"h{i}", "hog", served=i) for i in range(4)]
    light = req("l1", "light")
    running = [*hog, light]
    unfinished = {"hog": 8, "light": 2}
    reserved = {"hog": 1, "light": 2}
    slots = residency.plan(0, running, unfinished, reserved, feeds_two, 5)
    preempted = []
    victims = reclaim(residency, slots, running, preempted.append)
    # The most recently served of the hog's idle residents (its budget feeds
    # the least recently served one).
    assert victims == preempted == [hog[3]]
    assert slots.free == 1 and slots.preempted_ids == {"h3"}
    # Not taken again before it has sampled once more.
    running.remove(hog[3])
    running.append(hog[3])
    slots = residency.plan(1, running, unfinished, reserved, feeds_two, 5)
    again = reclaim(residency, slots, running, preempted.append)
    assert again == [hog[2]]
    hog[3].num_output_tokens += 1
    assert hog[3] in residency._idle_by_user(running, slots)["hog"]


def test_kv_reclaim_goes_on_until_the_blocks_are_there() -> None:
    residency = Residency()
    hog = [req(f"h{i}", "hog", served=i) for i in range(3)]
    free = [10]

    def preempt(victim) -> None:
        free[0] += 20

    slots = residency.plan(0, hog, {"hog": 5, "light": 1}, {"light": 1}, feeds_two, 8)
    victims = reclaim(residency, slots, hog, preempt, lambda: 45 - free[0])
    assert len(victims) == 2 and free[0] == 50


def test_recompute_counts_what_was_computed_before() -> None:
    residency = Residency()
    request = req("r", "hog", computed=100)
    residency.preempting(request)
    request.num_computed_tokens = 0
    requests = {"r": request}
    # Resumed with a 64-token prefix hit: 36 again in a 40-token chunk, then
    # nothing more once past where it was.
    request.num_computed_tokens = 104
    assert residency.count_recompute({"r": 40}, set(), requests) == {"hog": 36}
    assert not residency.recomputing
    # vLLM's own preemption, seen after the step: all but the last token.
    request.num_tokens, request.num_computed_tokens = 120, 0
    assert residency.count_recompute({}, {"r"}, requests) == {}
    request.num_computed_tokens = 119
    assert residency.count_recompute({"r": 119}, set(), requests) == {"hog": 119}
    residency.preempting(request)
    assert residency.count_recompute({}, set(), {}) == {}  # it finished
    assert not residency.recomputing
