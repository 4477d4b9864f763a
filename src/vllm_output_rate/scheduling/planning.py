"""The plan of a contested step: who holds the slots, and in which order.

A step is contested when someone may be refused, active slots are
contested or the step's tokens are shared (``step.StepMode``). Before
vLLM's ``schedule()`` runs it:

1. When requests wait: resident slots and KV blocks go to users with budget
   (``residency.py``): throttled residents are preempted for claimants,
   throttled users do not refill slots ahead of their budget, and vLLM's
   waiting scan is closed when nobody waiting can be admitted.
2. When the last step refused someone or left running requests without an
   active slot, or waiting requests of several users compete for the free
   active slots (``crowded``): the running list is ordered. Throttled
   requests go last (vLLM preempts the last one under KV pressure), a
   user's streams take turns, and contested active slots go to the users
   owed most service, running and waiting requests alike
   (``ordering.share_slots`` by ``fair_share.FairShare.key``).

3. When several users' work exceeds the step's token budget (long prompts
   beside short ones): each user gets a share of it (``token_shares``), so
   that one user's prefills cannot take every step.

The functions read and write the policy's long-lived state and the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from itertools import compress
from operator import not_
from types import MappingProxyType
from typing import TYPE_CHECKING

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request

from vllm_output_rate.scheduling import kv_room
from vllm_output_rate.scheduling.demand import last_served_of, user_of
from vllm_output_rate.scheduling.fair_share import PREFILL_TOKEN_COST, TURN_TOKENS
from vllm_output_rate.scheduling.ordering import rotate_within_groups, share_slots
from vllm_output_rate.scheduling.token_shares import share_tokens, step_needs
from vllm_output_rate.seams import num_free_kv_blocks, preempt

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.policy import OutputRatePolicy
    from vllm_output_rate.scheduling.step import Step
    from vllm_output_rate.scheduling.step_budget import StepBudget
    from vllm_output_rate.scheduling.step_slots import StepSlots
    from vllm_output_rate.seams import SchedulerHost

NOTHING: Mapping[str, int] = MappingProxyType({})


def crowded(policy: OutputRatePolicy) -> bool:
    """Whether waiting requests of several users compete for fewer free
    active slots than they are, with a resident slot free for them: then
    the slots go by rank (``fair_share``), not by queue order."""
    host = policy.host
    running = len(host.running)
    waiting = len(host.requests) - running
    if waiting <= 0 or running >= host.max_num_running_reqs:
        return False
    free_active = min(policy.active_cap, host.max_num_running_reqs) - running
    return waiting > free_active and len(policy.demand.unfinished) > 1


def token_needs(
    policy: OutputRatePolicy,
    budget: StepBudget,
    running_cap: int,
    granted: Mapping[str, int] | None = None,
) -> dict[str, int] | None:
    """What each user would compute in the step (``token_shares.py``),
    counted on the running list in its order with ``running_cap`` of them
    taking an active slot, and on the waiting requests the ranking
    ``granted`` slots to, if it did; None when no share can be needed.

    Only looked at when prompt work is possible: the last step computed
    prompt tokens (a prefill may go on), or requests wait with a resident
    slot free. Plain decoding costs nothing here."""
    host = policy.host
    if not policy.share_step_tokens or len(policy.demand.unfinished) < 2:
        return None
    slots = host.max_num_running_reqs
    free_slots = slots - len(host.running)
    waiting = len(host.requests) > len(host.running) and free_slots > 0
    prompt = policy.prompt_step
    cuts = prompt is not None and prompt.cuts
    if not (policy.prefilled or waiting or cuts):
        return None
    needs = step_needs(
        host.running,
        host.waiting if waiting else (),
        running_slots=min(running_cap, slots),
        active_slots=min(policy.active_cap, slots),
        resident_slots=free_slots,
        kv_tokens=num_free_kv_blocks(host) * host.block_size,
        budget=host.max_num_scheduled_tokens,
        allowance=budget.reserved,
        granted=granted,
    )
    if needs and prompt is not None and cuts:
        # Nobody needs a share of what its prompt rate will not let it use.
        needs = prompt.cap(needs)
    return needs


def token_shares(
    policy: OutputRatePolicy, budget: StepBudget, needs: Mapping[str, int] | None
) -> dict[str, int] | None:
    """Each user's share of the step's tokens when ``needs`` exceed them;
    None when vLLM may size every chunk. Users with budget go first."""
    if not needs:
        return None
    fair, reserved = policy.fair, budget.reserved
    tokens = policy.host.max_num_scheduled_tokens
    # A prefill's turn: one step of prompt tokens, in service.
    turn = PREFILL_TOKEN_COST * tokens
    return share_tokens(
        needs,
        tokens,
        lambda users: fair.ranks(users, turn, reserved),
        fair.weights_of,
    )


def plan_shared(
    policy: OutputRatePolicy,
    step: Step,
    crowded: bool,
    contested: bool,
    needs: dict[str, int],
    shares: dict[str, int],
) -> None:
    """Plan a step whose tokens are shared (``needs``, ``shares``): as any
    contested step if it is one for other reasons (rules 1 and 2), then
    rule 3, counted again on the running list as planned when the plan may
    have changed it."""
    host = policy.host
    if contested:
        reorders = crowded or policy.order_running
        resident = len(host.running)
        plan_contested(policy, step, crowded)
        granted = step.slots.granted if step.slots is not None else None
        if (
            reorders
            or len(host.running) != resident  # residents reclaimed
            or step.running_cap != step.active_cap
            or granted is not None
        ):
            counted = token_needs(policy, step.budget, step.running_cap, granted)
            shared = token_shares(policy, step.budget, counted)
            if not counted or not shared:
                return
            needs, shares = counted, shared
    give_token_shares(policy, step, needs, shares)


def give_token_shares(
    policy: OutputRatePolicy,
    step: Step,
    needs: Mapping[str, int],
    shares: dict[str, int],
) -> None:
    """Rule 3: the step's chunks are cut to ``shares``. Every user left
    short is backlogged in the step, and the running requests of users with
    a share go first (stable; a throttled user's after every other), so that
    vLLM's running loop spends the budget on them and ends there instead of
    visiting every other request only to skip it."""
    step.token_shares = shares
    step.deferred_users.update(
        user for user, share in shares.items() if share < needs[user]
    )
    reserved, running = step.budget.reserved, policy.host.running
    ahead = {user for user, share in shares.items() if share and reserved.get(user, 1)}
    first = list(map(ahead.__contains__, map(user_of, running)))
    running[:] = [*compress(running, first), *compress(running, map(not_, first))]


def plan_contested(
    policy: OutputRatePolicy,
    step: Step,
    crowded: bool,
    *,
    order: Callable[[OutputRatePolicy, Step], None] | None = None,
    resident: Mapping[str, int] | None = None,
) -> None:
    """Rules 1 and 2 of the module docstring, for ``step``. A shortcut may
    stand in for ``order_running`` (``order``, ordering the same) and pass
    the running requests per user (``resident``, as counted from
    ``running``)."""
    host = policy.host
    if len(host.requests) > len(host.running):
        _plan_residency(policy, step, resident)
    if policy.order_running or crowded:
        (order or order_running)(policy, step)


# ----- resident slots and KV blocks (residency.py) ---------------------------


def _plan_residency(
    policy: OutputRatePolicy, step: Step, resident: Mapping[str, int] | None
) -> None:
    host = policy.host
    unfinished = policy.demand.unfinished
    slots = policy.residency.plan(
        policy.limiter.now_ns(),
        host.running,
        unfinished,
        step.budget.reserved,
        policy.feed_cap,
        host.max_num_running_reqs,
        resident=resident,
    )
    if slots.outstanding:
        _reclaim(policy, slots)
    state = (len(host.requests), len(host.running), num_free_kv_blocks(host))
    if not policy.residency.scan_needed(slots, unfinished, state):
        step.close_admission()  # nobody waiting can be admitted
    step.slots = slots


def _reclaim(policy: OutputRatePolicy, slots: StepSlots) -> None:
    """Residency rule 1: preempt throttled residents for the claimants."""
    if not slots.may_give():
        return  # nobody could be taken: no need to look at the claims
    host = policy.host
    priority = host.policy == SchedulingPolicy.PRIORITY
    claimants = len(slots.wanted)
    kv_tight = kv_room.tight(host, claimants)
    heads: dict[str, Request] = {}
    if kv_tight or (priority and slots.free < slots.outstanding):
        heads = kv_room.claimant_heads(host.waiting, slots.wanted)
    required = kv_room.blocks_needed(host, heads.values()) if kv_tight else 0

    def preempt_for_claimant(request: Request) -> None:
        policy.residency.preempting(request)
        preempt(host, request)

    victims = policy.residency.reclaim(
        slots,
        host.running,
        feeds=policy.feed_cap,
        user_last_served=policy.user_last_served,
        blocks_missing=lambda: required - num_free_kv_blocks(host),
        preempt=preempt_for_claimant,
        claim_priority=(
            {user: r.priority for user, r in heads.items()} if priority else None
        ),
        fair=policy.fair,
    )
    if victims:
        policy.stats.record_reclaimed(Counter(map(user_of, victims)))


# ----- the running list -------------------------------------------------------


def waiting_room(host: SchedulerHost, slots: StepSlots | None) -> int:
    """How many active slots waiting requests may be granted: the free
    resident slots, and when KV blocks are tight no more than the claimants
    vLLM could admit (``kv_room.admissible``: a request preempted after
    sampling only if its tokens fit). A slot granted to a request vLLM
    cannot admit would stay empty for the step: with the cache full,
    preempted requests waiting to compute again would take the residents'
    slots step after step."""
    if slots is None or not slots.free:
        return 0
    if not kv_room.tight(host, len(slots.wanted)):
        return slots.free
    heads = kv_room.claimant_heads(host.waiting, slots.wanted)
    return min(slots.free, kv_room.admissible(host, heads.values()))


def order_running(policy: OutputRatePolicy, step: Step) -> None:
    """Rule 2 of the module docstring: order ``host.running`` for ``step``."""
    host, budget = policy.host, step.budget
    ready = [r for r in host.running if budget.has_budget(user_of(r))]
    throttled = [r for r in host.running if user_of(r) in budget.refused_users]
    priority = host.policy == SchedulingPolicy.PRIORITY
    slots = step.slots
    # Claimants compete for the active slots by rank (FCFS only: under
    # PRIORITY, waiting requests are admitted in vLLM's priority order).
    waiting = slots.wanted if slots is not None and not priority else NOTHING
    active = min(step.active_cap, host.max_num_running_reqs)
    if len(ready) + sum(waiting.values()) > active:
        if priority and slots is not None and slots.claimant_without_residents():
            # A user with budget waiting with nothing resident has been
            # served least recently of all: keep one slot for it (it may be
            # anywhere in the queue: the scan skips throttled requests ahead
            # of it).
            step.running_cap = step.active_cap - 1
        fair, last_served = policy.fair, policy.user_last_served
        previous = step.number - 1

        def turn_left(request: Request) -> int:
            # A request keeps its turn while it was served in the last step.
            return TURN_TOKENS if last_served_of(request) == previous else 0

        ranking = step.ranking = share_slots(
            ready,
            user_of,
            last_served_of,
            lambda user, k, turn: fair.key(user, k, last_served.get(user, -1), turn),
            turn_left=turn_left,
            weight_of=fair.weight,
            priority_of=(lambda r: r.priority) if priority else None,
            limit_of=budget.remaining,
            waiting=waiting,
            slots=active,
            room=waiting_room(host, slots),
        )
        ready, granted = ranking.order, ranking.granted
        if slots is not None and waiting:
            slots.granted = granted
            step.running_cap = active - sum(granted.values())
    else:
        ready = rotate_within_groups(
            ready,
            (lambda r: (user_of(r), r.priority)) if priority else user_of,
            last_served_of,
        )
    # FCFS preempts the last running request: make that a throttled one.
    host.running[:] = ready + throttled
    if priority:
        # PRIORITY preempts max(priority, arrival_time): within a priority,
        # make throttled requests look newest for the duration of the step.
        step.move_arrivals_last(throttled)
