"""Speed-only layers over the reference step, and the switch that removes them.

Each layer changes where the time goes, never what is decided:
``tests/scheduling/test_shortcuts.py`` runs randomized workloads with and
without them and asserts the same dispatches and charges, step by step.
``ReferenceStep`` is the plain path (``"shortcuts": false`` in the plugin's
settings); ``Shortcuts`` adds five layers:

* **vLLM's own hook in uncontested steps**, whose tokens are then charged
  from the step's output;
* **the kept batch** (``kept_batch.py``): a contested step on a saturated
  engine serves the last ranking's batch again without ranking;
* **ranking by rotations** (``rotations.py``): a contested step ranks from
  each user's requests kept in rotation between steps, at a cost that
  follows what changed, where ``share_slots`` would sort them all;
* **the batch alone in vLLM's loop** (``set_aside.py``): when a contested
  step can schedule nothing but its batch, the other running requests are
  set aside for vLLM's step and its waiting scan ends early;
* **settling beside the model**: ``end_step`` only notes the step; it is
  settled when vLLM asks for the grammar bitmask, after handing the step to
  the model worker, or by whichever entry point comes first.

How each works and why it pays: docs/architecture.md, "Shortcuts".
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from itertools import filterfalse, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request

from vllm_output_rate.scheduling import kv_room, planning, set_aside
from vllm_output_rate.scheduling.demand import LAST_SERVED_ATTR, last_served_of, user_of
from vllm_output_rate.scheduling.kept_batch import KeptBatch
from vllm_output_rate.scheduling.rotations import Rotations
from vllm_output_rate.scheduling.step import StepMode
from vllm_output_rate.seams import inflight_prefills, num_kv_cache_groups

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.policy import OutputRatePolicy
    from vllm_output_rate.scheduling.step import Step

Charges = tuple[Mapping[str, int], Mapping[str, int]]
_is_prefill_chunk = attrgetter("is_prefill_chunk")
_request_id = attrgetter("request_id")


class StepLayers(Protocol):
    # Whether ``end_step`` leaves the settling to a later entry point.
    settles_beside_model: bool

    def plan(self, policy: OutputRatePolicy, step: Step, crowded: bool) -> bool:
        """Plan ``step`` in place of the reference, if a layer can; False
        leaves it to the reference (``planning.py``)."""
        ...

    def charges(self, policy: OutputRatePolicy, step: Step) -> Charges | None:
        """(served, undispatched) per user of a step a layer ran with vLLM's
        hook; None: our hook charged it."""
        ...

    def settled(self, policy: OutputRatePolicy, step: Step) -> None: ...

    def forget(self) -> None:
        """Limits or weights changed: what a layer kept may be stale."""
        ...


class ReferenceStep:
    """No shortcut: every step as ``planning.py`` and ``step.py`` say."""

    settles_beside_model = False

    def plan(self, policy: OutputRatePolicy, step: Step, crowded: bool) -> bool:
        return False

    def charges(self, policy: OutputRatePolicy, step: Step) -> Charges | None:
        return None

    def settled(self, policy: OutputRatePolicy, step: Step) -> None:
        pass

    def forget(self) -> None:
        pass


class Shortcuts:
    settles_beside_model = True

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        # The batch the next step may keep (None: rank again).
        self.kept: KeptBatch | None = None
        # Each user's requests in rotation.
        self.rotations: Rotations[Request] = Rotations(
            user_of, last_served_of, _request_id
        )

    def forget(self) -> None:
        self.kept = None
        self.rotations.forget()

    def plan(self, policy: OutputRatePolicy, step: Step, crowded: bool) -> bool:
        if step.mode is StepMode.UNCONTESTED:
            self.kept = None
            step.vllm_hook = True
            return True
        kept = self.kept
        if kept is None or not self._may_keep(policy, step, kept):
            self.kept = None
            host = policy.host
            resumed = self.rotations.resume(
                step.number, host.running, host.finished_req_ids
            )
            planning.plan_contested(
                policy,
                step,
                crowded,
                order=self._order_running,
                resident=self.rotations.resident() if resumed else None,
            )
            set_aside.end_scan_with_grants(policy, step)
            step.vllm_hook = set_aside.for_ranked_batch(policy, step)
            return True
        step.mode = StepMode.KEPT
        # Every active slot stays with its request: no waiting request may
        # take one, so vLLM's waiting scan ends at once.
        step.close_admission()
        step.kept_waiting_users = kept.waiting_users
        step.vllm_hook = set_aside.for_kept_batch(policy, step, kept)
        return True

    def _may_keep(self, policy: OutputRatePolicy, step: Step, kept: KeptBatch) -> bool:
        """Whether ranking afresh would pick the kept batch (nothing it reads
        has changed, and its picks still rank first: ``kept_batch.py``)."""
        host = policy.host
        if not step.budget.covers_demand or host.finished_req_ids:
            return False
        if len(host.requests) != kept.requests or len(host.running) != kept.running:
            return False
        floors = policy.fair.ranked_floors
        if floors and not floors.keys().isdisjoint(policy.demand.unfinished):
            return False  # floor credit grows with time: rank again
        return kept.ranks_first

    def _order_running(self, policy: OutputRatePolicy, step: Step) -> None:
        """``planning.order_running``, by the rotations where they rank the
        same: every user covered (no request goes last for lack of budget),
        FCFS, no floor (its credit grows with time), more running and
        claimed requests than active slots (``ordering.share_slots``)."""
        host, fair, slots = policy.host, policy.fair, step.slots
        waiting = slots.wanted if slots is not None else planning.NOTHING
        active = min(step.active_cap, host.max_num_running_reqs)
        if (
            not step.budget.covers_demand
            or host.policy != SchedulingPolicy.FCFS
            or (
                fair.ranked_floors
                and not fair.ranked_floors.keys().isdisjoint(policy.demand.unfinished)
            )
            or len(host.running) + sum(waiting.values()) <= active
        ):
            planning.order_running(policy, step)
            return
        ranking = step.ranking = self.rotations.rank(
            step=step.number,
            running=host.running,
            waiting=waiting,
            slots=active,
            room=planning.waiting_room(host, slots),
            fair=fair,
            user_last_served=policy.user_last_served,
        )
        if slots is not None and waiting:
            slots.granted = ranking.granted
            step.running_cap = active - sum(ranking.granted.values())
        host.running[:] = ranking.order
        step.rotated = True

    def charges(self, policy: OutputRatePolicy, step: Step) -> Charges | None:
        if not step.vllm_hook:
            return None
        assert step.output is not None
        host, budget = policy.host, step.budget
        served = policy.accounting.charged_from_output(
            step.number,
            budget.taken_ns,
            step.output,
            host.requests,
            inflight_prefills(host),
            policy.demand,
            budget.reserved,
        )
        if not budget.spend_counts(served):
            self._logger.warning(
                "A step dispatched more tokens than it reserved: %s", served
            )
        if step.mode is not StepMode.UNCONTESTED:
            # What our hook would have noted: each request that sampled was
            # served (its turn), each of the batch took an active slot, the
            # ones set aside were deferred.
            scheduled = step.output.num_scheduled_tokens
            sampled: Iterable[Request] = map(host.requests.__getitem__, scheduled)
            if inflight_prefills(host):
                sampled = filterfalse(_is_prefill_chunk, sampled)
            deque(
                map(setattr, sampled, repeat(LAST_SERVED_ATTR), repeat(step.number)), 0
            )
            step.active = len(scheduled) - step.admitted
            if step.rotated:
                step.deferred_users.update(self.rotations.deferred_users)
            else:
                step.deferred_users.update(map(user_of, step.set_aside))
        return served, planning.NOTHING

    def settled(self, policy: OutputRatePolicy, step: Step) -> None:
        self.kept = self._batch_to_keep(policy, step)
        output = step.output
        assert output is not None
        if step.rotated or step.mode is StepMode.KEPT:
            host = policy.host
            self.rotations.settled(
                step.number,
                host.running,
                output.num_scheduled_tokens,
                preempted=bool(output.preempted_req_ids),
                sampled_all=not inflight_prefills(host),
                set_aside=bool(step.set_aside),
            )
        else:
            self.rotations.forget()

    def _batch_to_keep(self, policy: OutputRatePolicy, step: Step) -> KeptBatch | None:
        """The batch the next step may keep: this step's, if it was ranked
        (or kept) and changed nothing the ranking reads."""
        host, slots, ranking, output = (
            policy.host,
            step.slots,
            step.ranking,
            step.output,
        )
        assert output is not None
        kept = self.kept if step.mode is StepMode.KEPT else None
        if kept is None and step.rotated and not self.rotations.detailed:
            return None  # many users: ranking by the rotations costs what keeping does
        if policy.late_outputs:
            # vLLM passes over a request at its last token (and, with
            # pipeline parallelism, one not yet eligible): its active slot
            # goes to the next running request, the first deferred one. A
            # kept step leaves the running list in the last ranking's order,
            # not in the order ranking afresh leaves, so a later step passing
            # a pick over would fill its slot with another request.
            return None
        if (
            (kept is None and ranking is None)
            or step.token_shares is not None
            or host.policy == SchedulingPolicy.PRIORITY
            or step.budget.refused_users
            or step.throttled
            or output.preempted_req_ids
            or (slots is not None and slots.admissions)
            or step.active < step.running_cap
        ):
            return None
        if kept is None:
            assert ranking is not None
            kept = KeptBatch(
                last_picks=ranking.last_picks,
                next_slots=ranking.next_slots,
                rivals_key=ranking.rivals_key,
                waiting_users=frozenset(slots.left_waiting() if slots else ()),
            )
        for _, requests, _ in kept.last_picks.values():
            for request in requests:
                if last_served_of(request) != step.number:
                    return None  # not served (a prefill chunk): its turn moved
        kept.requests, kept.running = len(host.requests), len(host.running)
        # The free KV blocks a kept step needs to set the rest aside: the
        # same while ``running`` is as long.
        kept.kv_blocks_needed = (
            None
            if not policy.accounting.charges_known_at_dispatch or policy.late_outputs
            else kv_room.margin(host) + step.active_cap * num_kv_cache_groups(host)
        )
        # Whether ranking afresh would pick the batch again, asked here
        # (beside the model) rather than in the next schedule(): nothing the
        # answer reads changes before then, and what would (an operator's
        # update, a reload of the limits file) drops the kept batch.
        kept.ranks_first = kept.still_first(
            policy.fair, policy.user_last_served, policy.fair_growth
        )
        return kept


def layers_for(shortcuts: bool, logger: logging.Logger) -> StepLayers:
    return Shortcuts(logger) if shortcuts else ReferenceStep()
