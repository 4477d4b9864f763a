"""Settling a step: what it charged, what goes back, and what it leaves behind.

``settle(policy, step)`` runs once per step, after vLLM scheduled it and
before anything else reads or changes the scheduler (``policy.finish_step``):

* splits the tokens charged into dispatched and not (KV allocation failed,
  preempted, out of token budget) and returns every token reserved or
  charged but not dispatched, at this single refund point
  (``StepBudget.settle``);
* marks each served request's last served step (its turn, for ordering),
  in contested and kept steps;
* charges the step's service to the users' fair-share counters when the
  step left someone waiting, and credits floors (``fair_share.py``);
* charges the prompt tokens computed to users with a prompt rate
  (``prompt_budget.py``) and counts them in the statistics;
* keeps statistics, the dispatch log, first-token times, recomputation
  after preemption, and what the next step and the idle wait need.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from vllm_output_rate.scheduling.demand import LAST_SERVED_ATTR, user_of
from vllm_output_rate.scheduling.planning import NOTHING
from vllm_output_rate.scheduling.prompt_budget import computed_prompt_tokens
from vllm_output_rate.scheduling.speculative import num_drafts
from vllm_output_rate.scheduling.step import StepMode
from vllm_output_rate.seams import inflight_prefills

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_output_rate.scheduling.policy import OutputRatePolicy
    from vllm_output_rate.scheduling.step import Step

# Forget idle users' limiter state this often (in steps).
CLEANUP_EVERY_STEPS = 256
# Longest gap between steps counted in the step interval (an idle engine
# does not step at all).
MAX_STEP_INTERVAL_NS = 1_000_000_000


def settle(policy: OutputRatePolicy, step: Step) -> None:
    output = step.output
    assert output is not None, "settle() of a step vLLM has not scheduled"
    host, accounting = policy.host, policy.accounting
    charges = policy.shortcuts.charges(policy, step)
    if charges is None:
        charges = _sort_charged(policy, step, output)
        accounting.dispatched(
            step.number,
            step.budget.taken_ns,
            output,
            host.requests,
            inflight_prefills(host),
        )
    served, undispatched = charges
    # More tokens than one per request and its drafts: prompt tokens (the
    # fair-share counters below, and the next step's token shares).
    policy.prefilled = output.total_num_scheduled_tokens > len(
        output.num_scheduled_tokens
    ) + num_drafts(output)
    now_ns = step.end_ns
    policy.note_step_time(now_ns)
    policy.user_last_served.update(dict.fromkeys(served, step.number))
    received = accounting.received(served)
    # With prompt rates on, the step's prompt tokens per user, counted once
    # for the prompt budget, the statistics and the fair-share counters.
    computed = (
        None
        if step.prompt is None
        else computed_prompt_tokens(output.num_scheduled_tokens, host.requests)
    )
    _count_fair_shares(policy, step, output, received, now_ns, computed)
    if policy.dispatch_log:
        accounting.log(policy.dispatch_log, step.budget.taken_ns, served)
    if accounting.wants_grants():
        accounting.note_grants(step.number, now_ns, step.budget.kept(undispatched))
    policy.wakeup_ns = step.budget.settle(undispatched)
    policy.prompt_held = False
    if step.prompt is not None and computed is not None:
        policy.prompt_held = bool(step.prompt.budget.refused_users)
        # Every chunk counts: one cut to a single prompt token too.
        ready_ns = step.prompt.settle(computed)
        if computed:
            policy.stats.record_prompt_tokens(now_ns, computed)
        if ready_ns is not None:
            wakeup = policy.wakeup_ns
            policy.wakeup_ns = ready_ns if wakeup is None else min(wakeup, ready_ns)
    policy.stats.record_step(
        now_ns,
        received,
        undispatched,
        Counter(map(user_of, step.throttled)) if step.throttled else NOTHING,
    )
    if policy.first_tokens.waiting:
        policy.stats.record_first_tokens(
            now_ns,
            policy.first_tokens.sampled(output.num_scheduled_tokens, host.requests),
        )
    policy.last_step_idle = output.total_num_scheduled_tokens == 0
    # Order the next contested step's running list if this one refused
    # someone or left running requests without an active slot.
    policy.order_running = bool(step.budget.refused_users) or (
        len(host.running) > step.active_cap
    )
    if step.number % CLEANUP_EVERY_STEPS == 0:
        _forget_idle(policy, now_ns)
    policy.shortcuts.settled(policy, step)
    if step.slots is not None:
        policy.residency.scanned(step.slots)
    if output.preempted_req_ids or policy.residency.recomputing:
        recomputed = policy.residency.count_recompute(
            output.num_scheduled_tokens, output.preempted_req_ids, host.requests
        )
        if recomputed:
            policy.stats.record_recomputed(recomputed)


def _sort_charged(
    policy: OutputRatePolicy, step: Step, output: SchedulerOutput
) -> tuple[Counter[str], Counter[str]]:
    """Split the tokens our hook charged into dispatched and not; a request
    dispatched in a contested step was served in it (its turn)."""
    scheduled = output.num_scheduled_tokens
    charge_of = policy.accounting.charge_of
    turns = step.mode is not StepMode.UNCONTESTED
    served: Counter[str] = Counter()
    undispatched: Counter[str] = Counter()
    for request_id, request in step.charged.items():
        if request_id in scheduled:
            if turns:
                setattr(request, LAST_SERVED_ATTR, step.number)
            served[user_of(request)] += charge_of(request_id)
        else:
            undispatched[user_of(request)] += charge_of(request_id)
    return served, undispatched


def _count_fair_shares(
    policy: OutputRatePolicy,
    step: Step,
    output: SchedulerOutput,
    received: Mapping[str, int],
    now_ns: int,
    computed: Mapping[str, int] | None,
) -> None:
    """In a step that left someone waiting, charge its service to the users'
    virtual counters and raise the level to the least-served backlogged
    user; credit floors in every step.

    A step that left nobody waiting is not counted: everyone got all it
    asked for, so nobody is owed anything for it (and a user that ran more
    streams while the engine had room is not starved for it when the engine
    fills up). It also keeps plain decoding O(1) here."""
    fair = policy.fair
    backlogged: Collection[str] = step.deferred_users
    claimants = step.claimants_left_waiting()
    if claimants is not None:
        backlogged = step.deferred_users.union(claimants)
    else:
        host, unfinished = policy.host, policy.demand.unfinished
        if len(unfinished) == 1 and len(host.requests) > len(host.running):
            # One user alone with requests waiting: it is backlogged (steps
            # of one user do not rank, see planning.crowded).
            backlogged = unfinished.keys()
    policy.fair_growth = 0.0
    if backlogged:
        level = fair.level
        grown = fair.charge(received, _prompt_tokens(policy, output, computed))
        fair.backlogged(backlogged, step.budget.refused_users)
        policy.fair_growth = max(grown, fair.level - level)
    fair.credit_floors(now_ns, policy.demand.unfinished, received)


def _prompt_tokens(
    policy: OutputRatePolicy,
    output: SchedulerOutput,
    computed: Mapping[str, int] | None,
) -> Mapping[str, int]:
    """Prompt tokens computed in the step per user, for the fair-share
    counters: none in a step of one token per request plus its drafts
    (plain or speculative decoding, ``policy.prefilled`` false): O(1);
    ``computed`` when settling counted them already."""
    if not policy.prefilled:
        return NOTHING
    if computed is not None:
        return computed
    return computed_prompt_tokens(output.num_scheduled_tokens, policy.host.requests)


def _forget_idle(policy: OutputRatePolicy, now_ns: int) -> None:
    """Drop the state of users and requests that left (every
    ``CLEANUP_EVERY_STEPS`` steps)."""
    host = policy.host
    policy.limiter.cleanup_idle_users()
    if policy.prompt_limiter is not None:
        policy.prompt_limiter.cleanup_idle_users()
    live = {user_of(r) for r in host.running}
    policy.user_last_served = {
        u: s for u, s in policy.user_last_served.items() if u in live
    }
    policy.stats.forget_users(live, now_ns)
    policy.fair.forget(policy.demand.unfinished)
    policy.first_tokens.forget_finished(host.requests)
    policy.residency.forget(host.requests)
