"""Who may hold the engine's resident slots and KV blocks (no vLLM import).

``Residency`` keeps the lock-out rules' state across steps. Before each
contested step in which requests wait, ``plan`` counts the step's accounts
(``step_slots.StepSlots``: each user's resident requests, and the slots it
*claims*: those its budget can use beyond its resident ones); then:

1. ``reclaim`` preempts throttled residents (with the ``preempt`` it is
   given: vLLM's recompute preemption) for the claimants when resident slots
   or KV blocks are short; a request taken is not taken again before it has
   sampled once more;
2. no refill ahead of budget (``StepSlots.may_prefill_ahead``) while another
   user with budget claimed in the last ``CONTENTION_HOLD_NS``;
3. ``scan_needed``/``scanned`` close vLLM's waiting scan for a step that
   cannot admit anyone.

``count_recompute`` counts tokens computed again after any preemption. Why:
docs/architecture.md, "Nobody waits for a throttled request". Requests are
vLLM ``Request`` objects (read: ``request_id``, ``num_output_tokens``,
``num_computed_tokens``, ``num_tokens``, ``priority``, ``demand.py``'s tags).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vllm_output_rate.scheduling.demand import last_served_of, user_of
from vllm_output_rate.scheduling.fair_share import FairShare
from vllm_output_rate.scheduling.ordering import SlotHolders, claim_order
from vllm_output_rate.scheduling.step_slots import StepSlots

# How long after a user with budget last claimed a slot the engine counts as
# contested for everyone else (rule 2).
CONTENTION_HOLD_NS = 1_000_000_000
# A priority value no request has: nothing may be taken for it.
NO_VICTIM = sys.maxsize


class Residency:
    """The state rules 1 and 2 keep across steps, and the recompute count."""

    def __init__(self, hold_ns: int = CONTENTION_HOLD_NS) -> None:
        self._hold_ns = hold_ns
        # The two most recent claimants (distinct users) and when they
        # claimed: enough to tell whether anyone *else* claimed recently.
        self._recent_claims: list[tuple[str, int]] = []
        # Preempted by us: request id -> output tokens it had then.
        self._protected: dict[str, int] = {}
        # Preempted (by anyone) and not yet back where it was: request id ->
        # (user, tokens computed before the preemption).
        self._recomputing: dict[str, tuple[str, int]] = {}
        # The state of the last scan that admitted nothing (rule 3).
        self._fruitless_scan: tuple[Any, ...] | None = None

    # ----- planning a step ------------------------------------------------

    def plan(
        self,
        now_ns: int,
        running: Sequence[Any],
        unfinished: Mapping[str, int],
        reserved: Mapping[str, int],
        feed_cap: Callable[[str], int],
        max_resident: int,
        *,
        resident: Mapping[str, int] | None = None,
    ) -> StepSlots:
        """Count the step's residency and note who claims (rules 1 and 2).

        ``reserved`` maps users to the tokens they may sample in the step;
        ``feed_cap(user)`` is how many resident requests the user's rate can
        feed (rule 2's cap under contention); ``max_resident`` is
        ``--max-num-seqs``; ``resident``, if given, is ``running`` counted
        per user.
        """
        resident = Counter(resident or map(user_of, running))
        wanted = {}
        for user, count in unfinished.items():
            waiting = count - resident[user]
            spare = reserved.get(user, 0) - resident[user]
            if waiting > 0 and spare > 0:
                wanted[user] = min(waiting, spare)
        for user in wanted:
            self._note_claim(user, now_ns)
        contested_since = now_ns - self._hold_ns

        def may_grow(user: str, have: int) -> bool:
            if not self._claimed_by_others_since(user, contested_since):
                return True
            return have < feed_cap(user)

        free = max_resident - len(running)
        return StepSlots(resident, wanted, reserved, may_grow, free)

    def _note_claim(self, user: str, now_ns: int) -> None:
        recent = [(u, t) for u, t in self._recent_claims if u != user]
        self._recent_claims = [(user, now_ns), *recent[:1]]

    def _claimed_by_others_since(self, user: str, since_ns: int) -> bool:
        return any(u != user and t >= since_ns for u, t in self._recent_claims)

    # ----- rule 3 ---------------------------------------------------------

    def scan_needed(
        self, slots: StepSlots, unfinished: Mapping[str, int], state: tuple[Any, ...]
    ) -> bool:
        """Whether vLLM's waiting scan may admit anything in this step.

        Yes while a claim is outstanding. If only prefill ahead could
        admit, no when nobody may, or when the scan
        found nothing to admit before and neither ``state`` (the policy's
        view of what admission depends on: requests, residents, free KV
        blocks) nor the users that may prefill ahead have changed since:
        it would skip the same requests for the same reasons.
        """
        users = slots.prefill_ahead_users(unfinished)
        if users is None:
            return True
        if not users:
            return False
        scan_state = (state, users)
        if scan_state == self._fruitless_scan:
            return False
        slots.scan_state = scan_state
        return True

    def scanned(self, slots: StepSlots) -> None:
        """After the step: remember a prefill-ahead scan that admitted nothing."""
        if slots.scan_state is not None:
            self._fruitless_scan = None if slots.admissions else slots.scan_state

    # ----- rule 1 ---------------------------------------------------------

    def reclaim(
        self,
        slots: StepSlots,
        running: Sequence[Any],
        *,
        feeds: Callable[[str], int],
        user_last_served: Mapping[str, int],
        blocks_missing: Callable[[], int],
        preempt: Callable[[Any], None],
        claim_priority: Mapping[str, int] | None = None,
        fair: FairShare | None = None,
    ) -> list[Any]:
        """Preempt idle residents for the claimants; return the victims.

        First slots: each claimed slot beyond the free ones takes one idle
        resident (``ordering.SlotHolders``: from a user holding more than its
        rate can feed, ``feeds(user)``, or more than the claimant). Then KV:
        while ``blocks_missing()`` (blocks the claimants' first chunks still
        lack, re-read after each preemption) is positive, one more, for the
        claimant holding least.
        With ``claim_priority`` (PRIORITY policy: each claimant's best
        waiting priority), a victim's priority value is at least its
        claimant's: a better-priority request is never preempted for a worse
        one.
        """
        if not slots.outstanding:
            return []
        holders = SlotHolders(
            self._idle_by_user(running, slots),
            slots.resident,
            feeds,
            user_last_served,
            priority_of=_priority_of if claim_priority is not None else None,
            fair=fair,
        )
        if not holders:
            return []
        victims = []
        # The claimants' counts as planned; the slots they get are counted
        # by ``admitted`` when vLLM reaches their requests.
        planned = Counter(slots.resident)
        free_slots = slots.free
        claims = claim_order(slots.wanted, planned, user_last_served, fair)
        for user, before in claims:
            if free_slots > 0:
                free_slots -= 1
                continue
            victim = holders.take(before, _claimed(claim_priority, user))
            if victim is not None:
                victims.append(victim)
                preempt(victim)
        # KV: for the claimant holding least, and under PRIORITY only
        # requests no better than the best claimant's.
        neediest = min(slots.resident[user] for user in slots.wanted)
        best_priority = None
        if claim_priority is not None:
            best_priority = min(claim_priority.values(), default=NO_VICTIM)
        while blocks_missing() > 0:
            victim = holders.take(neediest, best_priority)
            if victim is None:
                break
            victims.append(victim)
            preempt(victim)
        slots.free += len(victims)
        for victim in victims:
            slots.preempted_ids.add(victim.request_id)
            self._protected[victim.request_id] = victim.num_output_tokens
        return victims

    def _idle_by_user(
        self, running: Iterable[Any], slots: StepSlots
    ) -> dict[str, list[Any]]:
        """Each user's residents its budget cannot feed in this step, best
        victim first (served most recently; worst priority first when
        priorities differ), without the protected ones."""
        resident, reserved = slots.resident, slots.reserved
        idle_users = {
            user
            for user, count in resident.items()
            if count > reserved.get(user, 0) and not slots.wanted.get(user)
        }
        if not idle_users:
            return {}
        by_user: dict[str, list[Any]] = {}
        protected = self._protected
        for request in running:
            user = user_of(request)
            if user in idle_users:
                by_user.setdefault(user, []).append(request)
        idle = {}
        for user, requests in by_user.items():
            # Rotation feeds the least recently served first: those stay.
            requests.sort(key=last_served_of)
            feeds = reserved.get(user, 0)
            candidates = requests[feeds:]
            candidates.reverse()
            candidates.sort(key=_priority_of, reverse=True)  # stable
            idle[user] = [
                r
                for r in candidates
                if r.num_output_tokens > protected.get(r.request_id, -1)
            ]
        return idle

    # ----- recompute ----------------------------------------------------------

    def preempting(self, request: Any) -> None:
        """Note, before it is preempted, how far ``request`` had computed."""
        self._recomputing[request.request_id] = (
            user_of(request),
            request.num_computed_tokens,
        )

    def count_recompute(
        self,
        scheduled: Mapping[str, int],
        preempted_ids: Iterable[str],
        requests: Mapping[str, Any],
    ) -> Counter[str]:
        """Tokens computed again in this step, per user, for requests that
        were preempted (by us, noted by ``preempting``, or by vLLM, which
        ``preempted_ids`` of the step name) and are not back yet.

        Call after vLLM's ``schedule()``, which has advanced each scheduled
        request's ``num_computed_tokens``. vLLM's own preemptions are seen
        only afterwards; a request it preempted had computed all its tokens
        but the last sampled one, unless it was preempted mid-prefill (then
        this over-counts by the prompt part it had not reached).
        """
        recomputing = self._recomputing
        for request_id in preempted_ids:
            if request_id not in recomputing:
                request = requests.get(request_id)
                if request is not None:
                    recomputing[request_id] = (
                        user_of(request),
                        request.num_tokens - 1,
                    )
        counts: Counter[str] = Counter()
        for request_id, (user, before) in list(recomputing.items()):
            count = scheduled.get(request_id)
            if count is None:
                if request_id not in requests:
                    del recomputing[request_id]  # finished or aborted
                continue
            after = requests[request_id].num_computed_tokens
            again = min(after, before) - (after - count)
            if again > 0:
                counts[user] += again
            if after >= before:
                del recomputing[request_id]
        return counts

    @property
    def recomputing(self) -> bool:
        return bool(self._recomputing)

    def forget(self, live_request_ids: Mapping[str, Any]) -> None:
        """Drop protection of requests that finished (memory bound)."""
        self._protected = {
            rid: n for rid, n in self._protected.items() if rid in live_request_ids
        }


def _priority_of(request: Any) -> int:
    return int(request.priority)


def _claimed(claim_priority: Mapping[str, int] | None, user: str) -> int | None:
    # A claimant whose priority is unknown (its request was not found in
    # the queue) takes no victim.
    return None if claim_priority is None else claim_priority.get(user, NO_VICTIM)
