"""Serving a contested step's batch with vLLM's own hook, the rest set aside.

In a contested step our per-request hook serves the first ``running_cap``
running requests (the batch: a ranking's picks, or a kept batch) and defers
every other, raising vLLM's admission bar by one for each. When no chunk can
be refused, passed over, cut short or fail, vLLM's running loop would see
the same with the other requests off its list: then they are set aside for
``schedule()`` (``Step.set_aside``, put back behind the batch by
``Step.undo``), the bar is lowered by what they would have raised it, and
vLLM's own hook stands in for ours (its loop visits the batch only, as
stock's does). ``for_kept_batch`` and ``for_ranked_batch`` say whether a
step can, and set it up; ``end_scan_with_grants`` ends vLLM's waiting scan
once the slots granted to waiting requests are taken. Speed only: the
shortcuts use them (``shortcuts.py``), the reference step never.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.sched.request_queue import SchedulingPolicy

from vllm_output_rate.scheduling import kv_room
from vllm_output_rate.seams import (
    chunks_follow_request_counts,
    inflight_prefills,
    input_token_budget,
    num_free_kv_blocks,
    num_kv_cache_groups,
)

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.kept_batch import KeptBatch
    from vllm_output_rate.scheduling.policy import OutputRatePolicy
    from vllm_output_rate.scheduling.step import Step


def for_kept_batch(policy: OutputRatePolicy, step: Step, kept: KeptBatch) -> bool:
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
        step.set_aside, step.batch = running[cap:], cap
        del running[cap:]
    return True


def for_ranked_batch(policy: OutputRatePolicy, step: Step) -> bool:
    """Whether a ranked step's deferred requests are set aside, off
    ``running`` for vLLM's step, with vLLM's own hook in place of ours.

    Our hook would serve the first ``running_cap`` running requests (the
    ranking's picks, each decoding one token) and defer every other,
    raising the admission bar by one for each. So when nobody can be
    refused, and no chunk can be passed over, cut short or fail:
    everyone covered, FCFS, plain accounts known at dispatch (no drafts,
    no late outputs), no prefill in flight, a free KV block for each
    pick in each group beyond ``kv_room.margin`` (vLLM would preempt the
    last request of ``running``), token and input budgets beyond the
    picks (so that our hook would have reached every deferred request),
    and, while waiting requests may be admitted, chunks not sized by
    request counts and no adapter limit (both read ``running``), the
    deferred requests go aside and the bar is lowered by what they
    would have raised it. ``Step.undo`` puts them back behind the picks.
    """
    host, cap = policy.host, step.running_cap
    running = host.running
    if (
        step.ranking is None
        or not 0 < cap < len(running)
        or not step.budget.covers_demand
        or host.policy != SchedulingPolicy.FCFS
        or not policy.accounting.charges_known_at_dispatch
        or policy.late_outputs
        or inflight_prefills(host)
        or host.max_num_scheduled_tokens <= cap
        or input_token_budget(host) <= cap
        or num_free_kv_blocks(host)
        < kv_room.margin(host) + cap * num_kv_cache_groups(host)
    ):
        return False
    if not step.admission_closed:
        if chunks_follow_request_counts(host) or policy.modes.max_loras:
            return False
        deferred = len(running) - cap
        host.max_num_active_reqs = min(
            step.active_cap, host.max_num_running_reqs - deferred
        )
    step.set_aside, step.batch = running[cap:], cap
    del running[cap:]
    return True


def end_scan_with_grants(policy: OutputRatePolicy, step: Step) -> None:
    """End vLLM's waiting scan once the slots granted by rank are taken.

    When everyone is covered and the ranking granted the waiting
    requests' slots (FCFS), ``Step.admit_waiting`` refuses every other
    waiting request, so the rest of the scan would only skip them (in
    order: the queue ends as it would). Skipped requests are noted by
    vLLM (its count of skipped waiting requests, a grammar or remote KV
    found ready) only when the scan reaches them, as in a kept step.
    """
    slots = step.slots
    if (
        slots is None
        or slots.granted is None
        or step.admission_closed
        or not step.budget.covers_demand
        or policy.host.policy != SchedulingPolicy.FCFS
    ):
        return
    if slots.grants_left():
        step.close_after_grants = True
    else:
        step.close_admission()
