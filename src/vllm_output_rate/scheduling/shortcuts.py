"""Speed-only layers over the reference step, and the switch that removes them.

Each layer changes where the time goes, never what is decided:
``tests/scheduling/test_shortcuts.py`` runs randomized workloads with and
without them and asserts the same dispatches and charges, step by step.
``ReferenceStep`` is the plain path (``"shortcuts": false`` in the plugin's
settings); ``Shortcuts`` adds three layers:

* **vLLM's own hook in uncontested steps**, whose tokens are then charged
  from the step's output;
* **the kept batch** (``kept_batch.py``): a contested step on a saturated
  engine serves the last ranking's batch again without ranking, with the
  other running requests set aside when it can schedule nothing else;
* **settling beside the model**: ``end_step`` only notes the step; it is
  settled when vLLM asks for the grammar bitmask, after handing the step to
  the model worker, or by whichever entry point comes first.

How each works and why it pays: docs/architecture.md, "Shortcuts".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from vllm.v1.core.sched.request_queue import SchedulingPolicy

from vllm_output_rate.scheduling import kv_room
from vllm_output_rate.scheduling.demand import LAST_SERVED_ATTR, last_served_of, user_of
from vllm_output_rate.scheduling.kept_batch import KeptBatch
from vllm_output_rate.scheduling.planning import NOTHING
from vllm_output_rate.scheduling.step import StepMode
from vllm_output_rate.seams import (
    inflight_prefills,
    num_free_kv_blocks,
    num_kv_cache_groups,
    passed_over_next_step,
)

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.policy import OutputRatePolicy
    from vllm_output_rate.scheduling.step import Step

Charges = tuple[Mapping[str, int], Mapping[str, int]]


class StepLayers(Protocol):
    # Whether ``end_step`` leaves the settling to a later entry point.
    settles_beside_model: bool

    def plan(self, policy: OutputRatePolicy, step: Step) -> bool:
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

    def plan(self, policy: OutputRatePolicy, step: Step) -> bool:
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

    def forget(self) -> None:
        self.kept = None

    def plan(self, policy: OutputRatePolicy, step: Step) -> bool:
        if step.mode is StepMode.UNCONTESTED:
            self.kept = None
            step.vllm_hook = True
            return True
        kept = self.kept
        if kept is None or not self._may_keep(policy, step, kept):
            self.kept = None
            return False
        step.mode = StepMode.KEPT
        # Every active slot stays with its request: no waiting request may
        # take one, so vLLM's waiting scan ends at once.
        step.close_admission()
        step.kept_waiting_users = kept.waiting_users
        step.vllm_hook = self._set_aside_unkept(policy, step, kept)
        return True

    def _may_keep(self, policy: OutputRatePolicy, step: Step, kept: KeptBatch) -> bool:
        """Whether ranking afresh would pick the kept batch (nothing it reads
        has changed, and its picks still rank first: ``kept_batch.py``)."""
        host = policy.host
        if not step.budget.covers_demand or host.finished_req_ids:
            return False
        if len(host.requests) != kept.requests or len(host.running) != kept.running:
            return False
        floors = policy.fair.floors
        if floors and not floors.keys().isdisjoint(policy.demand.unfinished):
            return False  # floor credit grows with time: rank again
        if not kept.ranks_first:
            return False
        # With late outputs vLLM passes over a request at its last token
        # (and, with pipeline parallelism, one not yet eligible): its active
        # slot would go to the next running request, not the next by rank.
        return not policy.late_outputs or not any(
            passed_over_next_step(host, request)
            for _, requests, _ in kept.last_picks.values()
            for request in requests
        )

    def _set_aside_unkept(
        self, policy: OutputRatePolicy, step: Step, kept: KeptBatch
    ) -> bool:
        """Whether vLLM's own hook can stand in for ours in this kept step.

        It can when the step can schedule nothing but the kept batch: the
        batch is the first ``active_cap`` running requests (each decodes one
        token, so our hook would have made them the active ones and deferred
        the rest), and the rest are set aside, off ``running`` for vLLM's
        step (``Step.undo`` puts them back behind the batch). Not when a
        chunk's charge depends on its drafts or a step's output comes late
        (``kv_blocks_needed`` is None then), not while a prefill continues
        (its chunk may not sample), and only when every request of the batch
        finds a free KV block for its token in each KV cache group (vLLM
        would preempt the last request of ``running``: with the rest set
        aside, one of the batch).
        """
        host = policy.host
        if (
            kept.kv_blocks_needed is None
            or inflight_prefills(host)
            or num_free_kv_blocks(host) < kept.kv_blocks_needed
        ):
            return False
        running, cap = host.running, step.active_cap
        if len(running) > cap:
            step.set_aside = running[cap:]
            del running[cap:]
        return True

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
        if step.mode is StepMode.KEPT:
            # What our hook would have noted: each request of the batch was
            # served (it sampled), the ones set aside were deferred.
            scheduled = step.output.num_scheduled_tokens
            requests = host.requests
            for request_id in scheduled:
                setattr(requests[request_id], LAST_SERVED_ATTR, step.number)
            step.active = len(scheduled)
            step.deferred_users.update(map(user_of, step.set_aside))
        return served, NOTHING

    def settled(self, policy: OutputRatePolicy, step: Step) -> None:
        self.kept = self._batch_to_keep(policy, step)

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
        if (
            (kept is None and ranking is None)
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
