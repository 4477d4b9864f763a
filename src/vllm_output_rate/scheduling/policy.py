"""The rate-limiting policy of one scheduler: every decision and all its state.

``OutputRatePolicy`` is held by the scheduler subclasses (``scheduler.py``)
as ``scheduler.output_rate``, the one attribute this plugin adds to vLLM's
scheduler; the subclasses only forward vLLM's hooks to it. The policy reads
and writes the scheduler through the attributes declared in
``seams.SchedulerHost``.

A step, as vLLM's ``schedule()`` runs it with these hooks:

1. ``begin_step``: reserve every user's allowance in one limiter call, sized
   to its unfinished requests (a request samples at most one token per
   step). When every reservation is whole and no active slot is contested,
   nobody can be refused: the step is a *fast* one and runs as stock vLLM's.
   Otherwise: resident slots and KV blocks go to users with budget
   (``residency.py``: throttled residents are preempted for them, throttled
   users do not refill slots ahead of their budget, and the waiting scan is
   closed when nobody waiting can be admitted), then the running list may be
   reordered (throttled requests last, a user's streams rotated, contested
   active slots handed to the users owed most service, running and waiting
   requests alike: ``fair_share.py``, ``ordering.share_slots``). A step on
   a saturated engine whose ranking could not pick otherwise keeps the last
   ranking's batch instead (``kept_batch.py``).
2. ``on_chunk`` (vLLM's ``_reserve_prefill_lookahead``), for every request
   vLLM sizes a chunk for, except in fast steps: a chunk that reaches the end
   of the sequence samples a token and is charged. Without budget the chunk
   is held back one position (chunked prefill) or the request is skipped:
   it keeps its KV blocks and worker slot, and vLLM's admission bar
   (``max_num_active_reqs``) is raised by one so that a waiting request can
   take its active slot.
3. ``admit_waiting`` (vLLM's ``_handle_blocked_waiting_request``): a waiting
   request of a user without budget stays queued, skipped in order, whenever
   admitting it could stop vLLM's scan for everyone behind it or take a
   place that a user with budget needs.
4. ``end_step_cleanup`` and ``end_step``: undo the step's temporary
   changes; charge a fast step's sampled tokens in one C-level pass, and
   return at the single refund point every token reserved or charged but not
   dispatched (KV allocation failed, preempted, out of token budget).
   ``end_step`` only notes the step: its work runs at the next call of
   ``finish_step``, which the scheduler makes while the model runs the step
   (vLLM's engine asks the scheduler for the step's grammar bitmask after
   dispatching the batch to the worker and before waiting for its output),
   and which every entry point into the scheduler and this policy makes
   first. So the bookkeeping happens before anything else reads or changes
   the scheduler, exactly as if it ran at the end of ``schedule()``, but off
   the engine's critical path.

``update_from_output`` never touches the limiter, which keeps asynchronous
scheduling possible.

With speculative decoding a sampling chunk is charged the most it can emit
(one token plus its drafts, which are trimmed first to the user's budget),
each user's reservation is sized to that, and the tokens the user did not
receive (rejected drafts, a stop, an abort) go back at the start of a later
step, before its reservation (``speculative.py``). What hybrid, multimodal,
KV-connector and LoRA engines ask of the hold-back and of admission is in
``engine_modes.py``.

Over 400 lines because it is the one place that holds a step's decisions and
state; every rule that can stand alone (budgets, demand, ordering, fair
shares, residency and KV room, engine modes, speculative accounts,
statistics) is in its own module, and what operators read and change of the
policy is in ``operator_view.py``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.budget import Budget
from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.identity import user_or_anonymous
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling import kv_room
from vllm_output_rate.scheduling.demand import (
    LAST_SERVED_ATTR,
    USER_ATTR,
    Demand,
    FirstTokens,
    last_served_of,
    user_of,
)
from vllm_output_rate.scheduling.dispatch_log import DispatchLog
from vllm_output_rate.scheduling.engine_modes import EngineModes
from vllm_output_rate.scheduling.fair_share import TURN_TOKENS, FairShare
from vllm_output_rate.scheduling.kept_batch import KeptBatch
from vllm_output_rate.scheduling.limits_file import LimitsFileWatcher
from vllm_output_rate.scheduling.operator_view import OperatorView
from vllm_output_rate.scheduling.ordering import (
    SharedSlots,
    rotate_within_groups,
    share_slots,
)
from vllm_output_rate.scheduling.residency import Residency, StepSlots
from vllm_output_rate.scheduling.speculative import SpeculativeLedger, num_drafts
from vllm_output_rate.scheduling.stats import OutputRateStats
from vllm_output_rate.scheduling.step_budget import StepBudget
from vllm_output_rate.seams import (
    inflight_prefills,
    num_free_kv_blocks,
    num_kv_cache_groups,
    preempt,
)
from vllm_output_rate.store.leases import LeasedLimiter

if TYPE_CHECKING:
    from vllm_output_rate.seams import SchedulerHost

# Longest idle wait of the engine loop while every runnable request is
# throttled: short enough to notice other asynchronous readiness (grammar
# compilation) promptly, long enough not to spin.
MAX_IDLE_WAIT_S = 0.050
# Forget idle users' limiter state this often (in steps).
CLEANUP_EVERY_STEPS = 256
# Longest gap between steps counted in the step interval (an idle engine
# does not step at all).
MAX_STEP_INTERVAL_NS = 1_000_000_000
# An empty, read-only count: building a Counter costs microseconds per step.
NOTHING: Mapping[str, int] = MappingProxyType({})


class OutputRatePolicy(OperatorView):
    def __init__(
        self,
        settings: OutputRateSettings,
        host: SchedulerHost,
        *,
        chunked_prefill: bool,
        prefix_caching: bool,
        logger: logging.Logger,
        num_spec_tokens: int = 0,
        late_outputs: bool = False,
        modes: EngineModes | None = None,
    ) -> None:
        self.settings = settings
        self._host = host
        self._logger = logger
        # --max-num-active-seqs; vLLM's own attribute is raised per step.
        self.active_cap = host.max_num_active_reqs
        self._chunked_prefill = chunked_prefill
        # Where a held-back prefill may stop, what may be admitted while
        # throttled, --max-loras (hybrid, multimodal, KV connectors, LoRA).
        self.modes = replace(
            modes or EngineModes(),
            chunked_prefill=chunked_prefill,
            prefix_caching=prefix_caching,
            hash_block_size=host.hash_block_size,
        )
        # Speculative decoding's accounts (None without it). `late_outputs`:
        # a step's output can arrive after the next step was scheduled.
        self._late_outputs = late_outputs
        self.speculative = (
            SpeculativeLedger(num_spec_tokens, late_refunds=late_outputs)
            if num_spec_tokens > 0
            else None
        )
        self.use_limiter(OutputRateLimiter(settings.default_rate, settings.user_rates))
        self.demand = Demand()
        # Weights and floors: who is owed service when the engine is full.
        self.fair = FairShare(settings.user_weights, settings.user_floors)
        self._deferred_users: set[str] = set()
        self.first_tokens = FirstTokens()
        self.stats = OutputRateStats(
            settings.metrics_users, settings.metrics_recent_users
        )
        self.dispatch_log = DispatchLog.from_env()
        self._limits_file = (
            LimitsFileWatcher(
                settings.config_file,
                logger.warning,
                capacity=settings.engine_capacity,
            )
            if settings.config_file
            else None
        )
        self.step = 0
        self._user_last_served: dict[str, int] = {}
        self._charged: dict[str, Request] = {}  # request id -> request, this step
        self._active_in_step = 0
        # Active slots the running requests may fill in this step.
        self._running_cap = self.active_cap
        self._engaged = False  # someone was throttled or the active cap binds
        # This step's ranking of the active slots, and the batch a later
        # step may keep without ranking again (``kept_batch.py``).
        self._ranking: SharedSlots[Request] | None = None
        self._kept: KeptBatch | None = None
        self._keeping = False  # this step keeps the batch
        # The most a user's counter grew in the last step (kept_batch.py).
        self._fair_growth = 0.0
        # Running requests off vLLM's running list for a kept step (put
        # back after vLLM's step, their users counted when it is settled).
        self._set_aside: list[Request] = []
        # The step scheduled but not yet settled (end_step, finish_step).
        self._unfinished_step: tuple[SchedulerOutput, bool] | None = None
        # Resident slots and KV for users with budget (slow steps only).
        self.residency = Residency()
        self.slots: StepSlots | None = None
        self._admission_closed = False
        # Average time between steps (EWMA), for what a user's rate can feed.
        self._step_interval_ns = 0
        self._last_step_ns: int | None = None
        self._wakeup_ns: int | None = None
        self._last_step_idle = False
        # Resident requests skipped for lack of budget in the last step.
        self.throttled: list[Request] = []
        # vLLM's own _reserve_prefill_lookahead, bound to the scheduler: the
        # fast path's stand-in for ours (set by the scheduler subclass).
        self.stock_hook: Callable[[Request, int, int], int] | None = None
        # Called by close(), e.g. to stop a shared store's refresher.
        self.on_close: list[Callable[[], None]] = []

    def use_limiter(self, limiter: Budget) -> None:
        """Account against ``limiter`` from the next step on."""
        self.limiter = limiter
        spec = self.speculative
        per_request = spec.tokens_per_request if spec is not None else 1
        self.budget = StepBudget(limiter, self._host.max_num_running_reqs * per_request)
        # Leases from a shared store are synchronised between steps.
        self.leases = limiter if isinstance(limiter, LeasedLimiter) else None
        if self.leases is not None:
            host = self._host
            self.leases.attach(lambda: bool(host.requests))

    def close(self) -> None:
        for callback in self.on_close:
            callback()
        self.on_close.clear()

    # ----- requests -----------------------------------------------------

    def tag(self, request: Request) -> None:
        """Parse a new request's user once; every step reads the attribute."""
        params = request.sampling_params
        setattr(
            request,
            USER_ATTR,
            user_or_anonymous(params.extra_args if params is not None else None),
        )
        setattr(request, LAST_SERVED_ATTR, -1)

    def added(self, request: Request) -> None:
        user = user_of(request)
        self.demand.add(request.request_id, user)
        self.first_tokens.add(request.request_id, user, self.limiter.now_ns())

    # ----- the step -----------------------------------------------------

    def begin_step(self) -> tuple[bool, dict[Request, float]]:
        """Reserve the step's budget and order the running list.

        Returns whether vLLM's own hook stands in for ours in this step (a
        fast step: nobody can be refused and no active slot is contested; or
        a kept step that can schedule only its batch) and the arrival times
        moved for the step (give them to ``end_step_cleanup``).
        """
        self.finish_step()
        host = self._host
        self.step += 1
        if self._limits_file and self._limits_file.poll(self.limiter, self.fair):
            self._kept = None
            self._logger.info("Limits file reloaded: %s", self.limits_summary())
        spec = self.speculative
        if spec is not None:
            self._give_back_undelivered(spec)
        demand: Mapping[str, int] = self.demand.count_unfinished(
            host.finished_req_ids, host.requests
        )
        if self.leases is not None:
            self.leases.between_steps(demand, self.demand.generation)
        if spec is not None:
            demand = spec.most_per_user(demand, self.demand.changes)
            spec.charges.clear()
        everyone_covered = self.budget.begin_step(demand)
        self._charged.clear()
        self._active_in_step = 0
        self._running_cap = self.active_cap
        self.throttled = []
        self._deferred_users.clear()
        self._set_aside = []
        host.max_num_active_reqs = self.active_cap
        crowded = self._crowded()
        fast = everyone_covered and len(host.running) <= self.active_cap and not crowded
        self.slots = None
        self._admission_closed = False
        self._ranking = None
        self._keeping = not fast and self._keeps_batch(everyone_covered)
        if self._keeping:
            # Every active slot stays with its request: no waiting request
            # may take one, so vLLM's waiting scan ends at once.
            host.max_num_active_reqs = 0
            self._admission_closed = True
            return self._set_aside_unkept(), {}
        self._kept = None
        if not fast and len(host.requests) > len(host.running):
            self._plan_residency()
        engaged = (self._engaged or crowded) and not fast
        moved_arrivals = self._plan_step() if engaged else {}
        return fast, moved_arrivals

    def _keeps_batch(self, everyone_covered: bool) -> bool:
        """Whether this step may serve the last ranking's batch again."""
        kept, host = self._kept, self._host
        if kept is None or not everyone_covered or host.finished_req_ids:
            return False
        if len(host.requests) != kept.requests or len(host.running) != kept.running:
            return False
        floors = self.fair.floors
        if floors and not floors.keys().isdisjoint(self.demand.unfinished):
            return False  # floor credit grows with time: rank again
        return kept.ranks_first

    def _set_aside_unkept(self) -> bool:
        """Whether vLLM's own hook can stand in for ours in this kept step.

        It can when the step can schedule nothing but the kept batch: the
        batch is the first ``active_cap`` running requests (every running
        request decodes one token, so the hook would have made them the
        active ones and deferred the rest), and the rest are set aside, off
        ``running`` for the duration of vLLM's step (``end_step_cleanup``
        puts them back behind the batch, where they were). Their users
        count as deferred, as the hook would have counted them. Then a kept
        step costs what a fast one does: no Python call per request, tokens
        charged after the step from what it scheduled.

        Not with speculative decoding (a chunk's charge depends on its
        drafts), not when a step's output comes late (asynchronous
        scheduling: vLLM skips a request at its last token before the hook),
        not while a prefill continues (its chunk may not sample), and only
        when every request of the batch finds a free KV block for its token
        in each KV cache group (vLLM would preempt the last request of
        ``running``: with the rest set aside, one of the batch).
        """
        host, kept = self._host, self._kept
        if (
            kept is None
            or kept.kv_blocks_needed is None
            or inflight_prefills(host)
            or num_free_kv_blocks(host) < kept.kv_blocks_needed
        ):
            return False
        running, cap = host.running, self.active_cap
        if len(running) > cap:
            # Their users count as deferred when the step is settled.
            self._set_aside = running[cap:]
            del running[cap:]
        return True

    def _batch_to_keep(self, output: SchedulerOutput) -> KeptBatch | None:
        """The batch the next step may keep: this step's, if it was ranked
        (or kept) and changed nothing the ranking reads."""
        host, slots, ranking = self._host, self.slots, self._ranking
        kept = self._kept if self._keeping else None
        if (
            (kept is None and ranking is None)
            or host.policy == SchedulingPolicy.PRIORITY
            or self.budget.refused_users
            or self.throttled
            or output.preempted_req_ids
            or (slots is not None and slots.admissions)
            or self._active_in_step < self._running_cap
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
        step = self.step
        for _, requests, _ in kept.last_picks.values():
            for request in requests:
                if last_served_of(request) != step:
                    return None  # not served (a prefill chunk): its turn moved
        kept.requests, kept.running = len(host.requests), len(host.running)
        # The free KV blocks a kept step needs to set the rest aside
        # (``_set_aside_unkept``): the same while ``running`` is as long.
        kept.kv_blocks_needed = (
            None
            if self.speculative is not None or self._late_outputs
            else kv_room.margin(host) + self.active_cap * num_kv_cache_groups(host)
        )
        # Whether ranking afresh would pick the batch again, asked here
        # (beside the model) rather than in the next schedule(): nothing the
        # answer reads (counters, last served steps, their growth) changes
        # before then, and what would (an operator's update, a reload of the
        # limits file) drops the kept batch.
        kept.ranks_first = kept.still_first(
            self.fair, self._user_last_served, self._fair_growth
        )
        return kept

    def _crowded(self) -> bool:
        """Whether waiting requests of several users compete for fewer free
        active slots than they are, with a resident slot free for them: then
        the slots go by rank (``fair_share``), not by queue order."""
        host = self._host
        running = len(host.running)
        waiting = len(host.requests) - running
        if waiting <= 0 or running >= host.max_num_running_reqs:
            return False
        free_active = min(self.active_cap, host.max_num_running_reqs) - running
        return waiting > free_active and len(self.demand.unfinished) > 1

    def end_step_cleanup(self, moved_arrivals: dict[Request, float]) -> None:
        """Undo the step's temporary changes (also when vLLM's step raised)."""
        self._host.max_num_active_reqs = self.active_cap
        if self._set_aside:
            self._host.running.extend(self._set_aside)
        self._restore_arrivals(moved_arrivals)

    def end_step(self, output: SchedulerOutput, stock_hook: bool) -> None:
        """Note the step just scheduled, for ``finish_step`` to settle.
        ``stock_hook``: vLLM's own hook stood in for ours (``begin_step``)."""
        self._unfinished_step = (output, stock_hook)

    def finish_step(self) -> None:
        """Settle the step ``end_step`` noted, if it is not yet: charge and
        refund its tokens, and keep statistics. Call it before anything reads
        or changes the scheduler or this policy (it is cheap when done)."""
        if self._unfinished_step is None:
            return
        output, stock_hook = self._unfinished_step
        self._unfinished_step = None
        now_ns = self.limiter.now_ns()
        served: Mapping[str, int]
        if stock_hook:
            served, undispatched = self._charge_dispatched(output), NOTHING
            if self._keeping:
                self._served_kept_batch(output)
                # The hook would have deferred the requests set aside.
                self._deferred_users.update(map(user_of, self._set_aside))
        else:
            served, undispatched = self._sort_charged(output)
            if self.speculative is not None:
                host = self._host
                self.speculative.record_step(
                    self.step,
                    self.budget.taken_ns,
                    output,
                    host.requests,
                    inflight_prefills(host),
                    self.speculative.charges,
                )
        self._settle(output, served, undispatched, now_ns)
        fast = stock_hook and not self._keeping
        self._kept = None if fast else self._batch_to_keep(output)
        if self.slots is not None:
            self.residency.scanned(self.slots)
        if output.preempted_req_ids or self.residency.recomputing:
            recomputed = self.residency.count_recompute(
                output.num_scheduled_tokens,
                output.preempted_req_ids,
                self._host.requests,
            )
            if recomputed:
                self.stats.record_recomputed(recomputed)

    def _served_kept_batch(self, output: SchedulerOutput) -> None:
        """What the hook would have noted of a kept step's batch (each of
        its requests sampled: ``_set_aside_unkept``)."""
        scheduled, requests, step = (
            output.num_scheduled_tokens,
            self._host.requests,
            self.step,
        )
        for request_id in scheduled:
            setattr(requests[request_id], LAST_SERVED_ATTR, step)
        self._active_in_step = len(scheduled)

    def _give_back_undelivered(self, spec: SpeculativeLedger) -> None:
        """Speculative decoding: return the tokens charged for reported steps
        that their users did not receive (before this step's reservation)."""
        limiter = self.limiter
        refunds = spec.refunds(limiter.refunds_absorbed)
        for user, count, later_takes in refunds.late:
            limiter.refund_late(user, count, later_takes)
        if refunds.plain:
            limiter.refund_many(refunds.plain)
        if spec.undercharged:
            self._logger.warning(
                "Users received more tokens than they were charged: %s",
                dict(spec.undercharged),
            )
            for user, count in spec.undercharged.items():
                limiter.take_up_to(user, count)

    # ----- resident slots and KV blocks (residency.py) --------------------

    def _plan_residency(self) -> None:
        """Rules 1-3 of ``residency.py`` for this step (someone waits)."""
        host = self._host
        unfinished = self.demand.unfinished
        slots = self.residency.plan(
            self.limiter.now_ns(),
            host.running,
            unfinished,
            self.budget.reserved,
            self._feed_cap,
            host.max_num_running_reqs,
        )
        if slots.outstanding:
            self._reclaim(slots)
        state = (len(host.requests), len(host.running), num_free_kv_blocks(host))
        if not self.residency.scan_needed(slots, unfinished, state):
            # Nobody waiting can be admitted: end vLLM's scan at once.
            host.max_num_active_reqs = 0
            self._admission_closed = True
        self.slots = slots

    def _feed_cap(self, user: str) -> int:
        """Resident requests ``user``'s rate can feed: the most tokens its
        limit admits in one step (each request samples at most one), plus
        one stream prefilled ahead."""
        return self.limiter.tokens_within(user, self._step_interval_ns) + 1

    def _reclaim(self, slots: StepSlots) -> None:
        """Rule 1: preempt throttled residents for the claimants."""
        host = self._host
        priority = host.policy == SchedulingPolicy.PRIORITY
        claimants = len(slots.wanted)
        kv_tight = num_free_kv_blocks(host) < kv_room.blocks_bound(host, claimants)
        heads: dict[str, Request] = {}
        if kv_tight or (priority and slots.free < slots.outstanding):
            heads = kv_room.claimant_heads(host.waiting, slots.wanted)
        required = kv_room.blocks_needed(host, heads.values()) if kv_tight else 0
        victims = self.residency.reclaim(
            slots,
            host.running,
            feeds=self._feed_cap,
            user_last_served=self._user_last_served,
            blocks_missing=lambda: required - num_free_kv_blocks(host),
            preempt=self._preempt,
            claim_priority=(
                {user: r.priority for user, r in heads.items()} if priority else None
            ),
            fair=self.fair,
        )
        if victims:
            self.stats.record_reclaimed(Counter(map(user_of, victims)))

    def _preempt(self, request: Request) -> None:
        self.residency.preempting(request)
        preempt(self._host, request)

    # ----- the running list ------------------------------------------------

    def _plan_step(self) -> dict[Request, float]:
        """Order the running list for this step; see the module docstring."""
        host, budget = self._host, self.budget
        ready = [r for r in host.running if budget.has_budget(user_of(r))]
        throttled = [r for r in host.running if user_of(r) in budget.refused_users]
        priority = host.policy == SchedulingPolicy.PRIORITY
        slots = self.slots
        # Claimants compete for the active slots by rank (FCFS only: under
        # PRIORITY, waiting requests are admitted in vLLM's priority order).
        waiting = slots.wanted if slots is not None and not priority else NOTHING
        active = min(self.active_cap, host.max_num_running_reqs)
        if len(ready) + sum(waiting.values()) > active:
            if priority and slots is not None and slots.claimant_without_residents():
                # A user with budget waiting with nothing resident has been
                # served least recently of all: keep one slot for it (it
                # may be anywhere in the queue: the scan skips throttled
                # requests ahead of it).
                self._running_cap = self.active_cap - 1
            fair, last_served = self.fair, self._user_last_served
            ranking = self._ranking = share_slots(
                ready,
                user_of,
                last_served_of,
                lambda user, k, turn: fair.key(
                    user, k, last_served.get(user, -1), turn
                ),
                turn_left=self._turn_left,
                weight_of=fair.weight,
                priority_of=(lambda r: r.priority) if priority else None,
                limit_of=budget.remaining,
                waiting=waiting,
                slots=active,
                room=slots.free if slots is not None else 0,
            )
            ready, granted = ranking.order, ranking.granted
            if slots is not None and waiting:
                slots.granted = granted
                self._running_cap = active - sum(granted.values())
        else:
            ready = rotate_within_groups(
                ready,
                (lambda r: (user_of(r), r.priority)) if priority else user_of,
                last_served_of,
            )
        # FCFS preempts the last running request: make that a throttled one.
        host.running[:] = ready + throttled
        if not priority:
            return {}
        # PRIORITY preempts max(priority, arrival_time): within a priority,
        # make throttled requests look newest for the duration of the step.
        moved = {r: r.arrival_time for r in throttled}
        for request in throttled:
            request.arrival_time = math.inf
        return moved

    def _restore_arrivals(self, moved: dict[Request, float]) -> None:
        preempted = []
        for request, arrival_time in moved.items():
            request.arrival_time = arrival_time
            if request.status == RequestStatus.PREEMPTED:
                preempted.append(request)
        if preempted:
            # They entered the waiting heap with the temporary key; re-insert
            # them with the real one.
            waiting = self._host.waiting
            waiting.remove_requests(preempted)
            for request in preempted:
                waiting.add_request(request)

    def _charge_dispatched(self, output: SchedulerOutput) -> Mapping[str, int]:
        """Fast path: charge each user the sampling chunks dispatched."""
        host = self._host
        served: Mapping[str, int]
        if self.speculative is not None:
            # The most each chunk can emit (it may carry draft tokens).
            served = self.speculative.record_step(
                self.step,
                self.budget.taken_ns,
                output,
                host.requests,
                inflight_prefills(host),
                None,
                reserved=self.budget.reserved,
            )
        else:
            served = self.demand.count_sampled(
                output.num_scheduled_tokens, inflight_prefills(host), host.requests
            )
        if not self.budget.spend_counts(served):
            self._logger.warning(
                "A step dispatched more tokens than it reserved: %s", served
            )
        return served

    def _sort_charged(
        self, output: SchedulerOutput
    ) -> tuple[Counter[str], Counter[str]]:
        """Split the tokens the hook charged into dispatched and not."""
        scheduled = output.num_scheduled_tokens
        spec = self.speculative
        charges = spec.charges if spec is not None else None
        served: Counter[str] = Counter()
        undispatched: Counter[str] = Counter()
        for request_id, request in self._charged.items():
            count = charges[request_id] if charges is not None else 1
            if request_id in scheduled:
                setattr(request, LAST_SERVED_ATTR, self.step)
                served[user_of(request)] += count
            else:
                undispatched[user_of(request)] += count
        return served, undispatched

    def _settle(
        self,
        output: SchedulerOutput,
        served: Mapping[str, int],
        undispatched: Mapping[str, int],
        now_ns: int,
    ) -> None:
        """The single refund point, plus bookkeeping for the next step."""
        host = self._host
        spec = self.speculative
        if self._last_step_ns is not None:
            interval = min(now_ns - self._last_step_ns, MAX_STEP_INTERVAL_NS)
            self._step_interval_ns += (interval - self._step_interval_ns) // 8
        self._last_step_ns = now_ns
        self._user_last_served.update(dict.fromkeys(served, self.step))
        # What users received: with speculative decoding, known only for
        # the steps reported since the last step.
        received = served if spec is None else spec.delivered
        self._count_fair_shares(output, served, received, now_ns)
        if self.dispatch_log:
            # Stamped with the time the tokens were taken (the step's start),
            # so that windows between stamps are the limiter's own.
            if spec is None:
                self.dispatch_log.record(self.budget.taken_ns, served)
            else:
                for time_ns, tokens in spec.delivered_at:
                    self.dispatch_log.record(time_ns, tokens)
        if spec is not None and spec.wants_grants:
            spec.note_grants(self.step, now_ns, self.budget.kept(undispatched))
        self._wakeup_ns = self.budget.settle(undispatched)
        self.stats.record_step(
            now_ns,
            received,
            undispatched,
            Counter(map(user_of, self.throttled)) if self.throttled else NOTHING,
        )
        if self.first_tokens.waiting:
            self.stats.record_first_tokens(
                now_ns,
                self.first_tokens.sampled(output.num_scheduled_tokens, host.requests),
            )
        self._last_step_idle = output.total_num_scheduled_tokens == 0
        self._engaged = bool(self.budget.refused_users) or (
            len(host.running) > self.active_cap
        )
        if self.step % CLEANUP_EVERY_STEPS == 0:
            self.limiter.cleanup_idle_users()
            live = {user_of(r) for r in host.running}
            self._user_last_served = {
                u: s for u, s in self._user_last_served.items() if u in live
            }
            self.stats.forget_users(live, now_ns)
            self.fair.forget(self.demand.unfinished)
            self.first_tokens.forget_finished(host.requests)
            self.residency.forget(host.requests)

    def _count_fair_shares(
        self,
        output: SchedulerOutput,
        served: Mapping[str, int],
        received: Mapping[str, int],
        now_ns: int,
    ) -> None:
        """In a step that left someone waiting, charge its service to the
        users' virtual counters and raise the level to the least-served
        backlogged user; credit floors in every step.

        A step that left nobody waiting is not counted: everyone got all it
        asked for, so nobody is owed anything for it (and a user that ran
        more streams while the engine had room is not starved for it when
        the engine fills up). It also keeps plain decoding O(1) here."""
        fair = self.fair
        backlogged: Collection[str] = self._deferred_users
        if self.slots is not None and self.slots.wanted:
            backlogged = self._deferred_users.union(self.slots.left_waiting())
        elif self._keeping and self._kept is not None:
            backlogged = self._deferred_users.union(self._kept.waiting_users)
        else:
            host, unfinished = self._host, self.demand.unfinished
            if len(unfinished) == 1 and len(host.requests) > len(host.running):
                # One user alone with requests waiting: it is backlogged
                # (steps of one user do not rank, see _crowded).
                backlogged = unfinished.keys()
        self._fair_growth = 0.0
        if backlogged:
            level = fair.level
            grown = fair.charge(received, self._prompt_tokens(output))
            fair.backlogged(backlogged, self.budget.refused_users)
            self._fair_growth = max(grown, fair.level - level)
        fair.credit_floors(now_ns, self.demand.unfinished, received)

    def _turn_left(self, request: Request) -> int:
        """The request's turn (``fair_share.TURN_TOKENS``): kept on while it
        was served in the previous step, none otherwise."""
        return TURN_TOKENS if last_served_of(request) == self.step - 1 else 0

    def _prompt_tokens(self, output: SchedulerOutput) -> Mapping[str, int]:
        """Prompt tokens computed in the step per user (prefill, recompute):
        a request's scheduled tokens before its last known token. A step of
        one token per request plus its drafts (plain or speculative
        decoding) has none: O(1), or O(requests) in C with drafts."""
        scheduled = output.num_scheduled_tokens
        if output.total_num_scheduled_tokens == len(scheduled) + num_drafts(output):
            return NOTHING
        requests = self._host.requests
        counts: Counter[str] = Counter()
        for request_id, count in scheduled.items():
            if count > 1:
                request = requests.get(request_id)
                if request is None:
                    continue
                after = request.num_computed_tokens
                prompt = min(after, request.num_tokens - 1) - (after - count)
                if prompt > 0:
                    counts[user_of(request)] += prompt
        return counts

    # ----- vLLM's per-request hooks --------------------------------------

    def on_chunk(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """Charge, hold back or skip the chunk vLLM sized for ``request``.

        Returns the tokens to compute for it in this step (0: skip it).
        """
        if num_new_tokens <= 0:
            return num_new_tokens
        in_running_loop = request.status == RequestStatus.RUNNING
        user = user_of(request)
        end = request.num_tokens + request.num_output_placeholders
        samples = (
            num_computed_tokens + num_new_tokens >= end
            and request.request_id not in self._charged  # never charge twice
        )
        if samples and not self.budget.has_budget(user):
            # No budget: compute the prompt up to the sampling position only.
            held_back = self.modes.hold_back_end(request, end) - num_computed_tokens
            if not (self._chunked_prefill and held_back > 0):
                if in_running_loop:
                    # Skipped: it keeps its KV blocks and worker slot but
                    # gives its active slot to a waiting request.
                    self.throttled.append(request)
                    self._raise_admission_cap()
                return 0
            samples = False
            num_new_tokens = min(num_new_tokens, held_back)
        if in_running_loop:
            if self._active_in_step >= self._running_cap:
                # Deferred: no active slot left for it in this step. Like a
                # throttled request, it does not count as active for the
                # admission of waiting requests.
                self._deferred_users.add(user)
                self._raise_admission_cap()
                return 0
            self._active_in_step += 1
        if samples:
            count = 1
            if self.speculative is not None:
                # The most it can emit: one token plus its drafts, which are
                # trimmed first to what the user's budget covers.
                num_new_tokens, count = self.speculative.fit_drafts(
                    request,
                    num_new_tokens - (end - num_computed_tokens),
                    num_new_tokens,
                    in_running_loop,
                    self.budget.remaining(user),
                )
            self.budget.spend(user, count)
            self._charged[request.request_id] = request
        return num_new_tokens

    def _raise_admission_cap(self) -> None:
        """Let a resident request that is skipped in this step not count.

        vLLM admits a waiting request while ``len(running)`` is below
        ``max_num_active_reqs``; each skipped resident request raises that
        bar by one, never beyond ``--max-num-seqs`` (the worker slots).
        """
        if self._admission_closed:
            return
        host = self._host
        host.max_num_active_reqs = min(
            host.max_num_running_reqs, host.max_num_active_reqs + 1
        )

    def admit_waiting(self, request: Request) -> bool:
        """Whether vLLM may try to admit this waiting request now."""
        if not self.modes.adapter_fits(request, self.step, self._host.running):
            return False
        user = user_of(request)
        slots = self.slots
        if slots is not None and request.request_id in slots.preempted_ids:
            return False  # never resumed in the step that preempted it
        if self.budget.has_budget(user):
            # Slots taken back for claimants are theirs.
            admit = slots is None or slots.may_take_a_slot(user)
        elif slots is not None and not slots.may_prefill_ahead(user):
            return False  # its place is for users with budget (rule 2)
        else:
            admit = self._may_prefill_ahead(request)
        if admit and slots is not None:
            slots.admitted(user)
        return admit

    def _may_prefill_ahead(self, request: Request) -> bool:
        # The user has no budget, so this request could at most prefill up to
        # its sampling position. Leave it in the queue (skipped, order kept)
        # whenever admitting it could stop vLLM's scan for everyone behind
        # it, or would only repeat work:
        # - its first chunk may have to sample (nothing to prefill ahead);
        # - it was preempted for KV space, which it would take again just to
        #   wait;
        # - its prompt does not fit in the free KV blocks (vLLM ends the scan
        #   at a failed allocation).
        return not (
            self.modes.may_only_run_by_sampling(request)
            or request.status == RequestStatus.PREEMPTED
            or kv_room.blocks_for(self._host, request.num_tokens)
            > num_free_kv_blocks(self._host)
        )

    # ----- for the engine loop ------------------------------------------

    def idle_wait_s(self) -> float:
        """How long the engine may wait for input before the next step.

        Non-zero only when the last step dispatched no work and some user was
        refused: then nothing can run before that user's next token is due
        (or a new request or abort arrives, which wakes the loop at once).
        """
        self.finish_step()
        if not self._last_step_idle or self._wakeup_ns is None:
            return 0.0
        delay_ns = self._wakeup_ns - self.limiter.now_ns()
        return min(MAX_IDLE_WAIT_S, max(0.0, delay_ns / 1e9))
