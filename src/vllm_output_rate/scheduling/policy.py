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
   Otherwise the running list may be reordered (throttled requests last, a
   user's streams rotated, active slots shared round-robin between users).
2. ``on_chunk`` (vLLM's ``_reserve_prefill_lookahead``), for every request
   vLLM sizes a chunk for, except in fast steps: a chunk that reaches the end
   of the sequence samples a token and is charged. Without budget the chunk
   is held back one position (chunked prefill) or the request is skipped:
   it keeps its KV blocks and worker slot, and vLLM's admission bar
   (``max_num_active_reqs``) is raised by one so that a waiting request can
   take its active slot.
3. ``admit_waiting`` (vLLM's ``_handle_blocked_waiting_request``): a waiting
   request of a user without budget stays queued, skipped in order, whenever
   admitting it could stop vLLM's scan for everyone behind it.
4. ``end_step_cleanup`` and ``end_step``: undo the step's temporary
   changes; charge a fast step's sampled tokens in one C-level pass, and
   return at the single refund point every token reserved or charged but not
   dispatched (KV allocation failed, preempted, out of token budget).

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
state; every rule that can stand alone (budgets, demand, ordering, engine
modes, speculative accounts, statistics) is in its own module.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.config import (
    DEFAULT_KEY,
    USERS_KEY,
    OutputRateSettings,
    parse_limits_update,
)
from vllm_output_rate.identity import user_or_anonymous
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling.demand import (
    LAST_SERVED_ATTR,
    USER_ATTR,
    Demand,
    last_served_of,
    user_of,
)
from vllm_output_rate.scheduling.dispatch_log import DispatchLog
from vllm_output_rate.scheduling.engine_modes import EngineModes
from vllm_output_rate.scheduling.limits_file import LimitsFileWatcher
from vllm_output_rate.scheduling.ordering import fair_order, rotate_within_groups
from vllm_output_rate.scheduling.speculative import SpeculativeLedger
from vllm_output_rate.scheduling.stats import OutputRateStats
from vllm_output_rate.scheduling.step_budget import StepBudget
from vllm_output_rate.seams import inflight_prefills

if TYPE_CHECKING:
    from vllm_output_rate.seams import SchedulerHost

# Longest idle wait of the engine loop while every runnable request is
# throttled: short enough to notice other asynchronous readiness (grammar
# compilation) promptly, long enough not to spin.
MAX_IDLE_WAIT_S = 0.050
# Forget idle users' limiter state this often (in steps).
CLEANUP_EVERY_STEPS = 256
# An empty, read-only count: building a Counter costs microseconds per step.
NOTHING: Mapping[str, int] = MappingProxyType({})


class OutputRatePolicy:
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
        self.speculative = (
            SpeculativeLedger(num_spec_tokens, late_refunds=late_outputs)
            if num_spec_tokens > 0
            else None
        )
        self.use_limiter(OutputRateLimiter(settings.default_rate, settings.user_rates))
        self.demand = Demand()
        self.stats = OutputRateStats(settings.user_rates)
        self.dispatch_log = DispatchLog.from_env()
        self._limits_file = (
            LimitsFileWatcher(settings.config_file, logger.warning)
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
        self._wakeup_ns: int | None = None
        self._last_step_idle = False
        # Resident requests skipped for lack of budget in the last step.
        self.throttled: list[Request] = []
        # vLLM's own _reserve_prefill_lookahead, bound to the scheduler: the
        # fast path's stand-in for ours (set by the scheduler subclass).
        self.stock_hook: Callable[[Request, int, int], int] | None = None

    def use_limiter(self, limiter: OutputRateLimiter) -> None:
        """Account against ``limiter`` from the next step on."""
        self.limiter = limiter
        spec = self.speculative
        per_request = spec.tokens_per_request if spec is not None else 1
        self.budget = StepBudget(limiter, self._host.max_num_running_reqs * per_request)

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
        self.demand.add(request.request_id, user_of(request))

    # ----- the step -----------------------------------------------------

    def begin_step(self) -> tuple[bool, dict[Request, float]]:
        """Reserve the step's budget and order the running list.

        Returns whether the step is a fast one (nobody can be refused and no
        active slot is contested) and the arrival times moved for the step
        (give them to ``end_step_cleanup``).
        """
        host = self._host
        self.step += 1
        if self._limits_file and self._limits_file.poll(self.limiter):
            self.stats.set_named_users(self.limiter.user_rates)
            self._logger.info("Limits file reloaded: %s", self.limits())
        spec = self.speculative
        if spec is not None:
            self._give_back_undelivered(spec)
        demand: Mapping[str, int] = self.demand.count_unfinished(
            host.finished_req_ids, host.requests
        )
        if spec is not None:
            per_request = spec.tokens_per_request
            demand = {user: n * per_request for user, n in demand.items()}
            spec.charges.clear()
        everyone_covered = self.budget.begin_step(demand)
        self._charged.clear()
        self._active_in_step = 0
        self._running_cap = self.active_cap
        self.throttled = []
        host.max_num_active_reqs = self.active_cap
        fast = everyone_covered and len(host.running) <= self.active_cap
        moved_arrivals = self._plan_step() if self._engaged and not fast else {}
        return fast, moved_arrivals

    def end_step_cleanup(self, moved_arrivals: dict[Request, float]) -> None:
        """Undo the step's temporary changes (also when vLLM's step raised)."""
        self._host.max_num_active_reqs = self.active_cap
        self._restore_arrivals(moved_arrivals)

    def end_step(self, output: SchedulerOutput, fast: bool) -> None:
        """Charge and refund the step's tokens, and keep statistics."""
        now_ns = self.limiter.now_ns()
        served: Mapping[str, int]
        if fast:
            served, undispatched = self._charge_dispatched(output, now_ns), NOTHING
        else:
            served, undispatched = self._sort_charged(output)
            if self.speculative is not None:
                host = self._host
                self.speculative.record_step(
                    self.step,
                    now_ns,
                    output,
                    host.requests,
                    inflight_prefills(host),
                    self.speculative.charges,
                )
        self._settle(output, served, undispatched, now_ns)

    def _give_back_undelivered(self, spec: SpeculativeLedger) -> None:
        """Speculative decoding: return the tokens charged for reported steps
        that their users did not receive (before this step's reservation)."""
        limiter = self.limiter
        refunds = spec.refunds()
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

    def _plan_step(self) -> dict[Request, float]:
        """Order the running list for this step; see the module docstring."""
        host, budget = self._host, self.budget
        ready = [r for r in host.running if budget.has_budget(user_of(r))]
        throttled = [r for r in host.running if user_of(r) in budget.refused_users]
        priority = host.policy == SchedulingPolicy.PRIORITY
        if len(ready) >= self.active_cap:
            # Active slots are contested. A user waiting at the head of the
            # queue with nothing resident has been served least recently of
            # all: keep one slot for it rather than let resident users fill
            # every slot forever.
            if host.waiting and user_of(host.waiting.peek_request()) not in {
                user_of(r) for r in ready
            }:
                self._running_cap = self.active_cap - 1
            ready = fair_order(
                ready,
                user_of,
                last_served_of,
                self._user_last_served,
                priority_of=(lambda r: r.priority) if priority else None,
            )
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

    def _charge_dispatched(
        self, output: SchedulerOutput, now_ns: int
    ) -> Mapping[str, int]:
        """Fast path: charge each user the sampling chunks dispatched."""
        host = self._host
        served: Mapping[str, int]
        if self.speculative is not None:
            # The most each chunk can emit (it may carry draft tokens).
            served = self.speculative.record_step(
                self.step, now_ns, output, host.requests, inflight_prefills(host), None
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
        self._user_last_served.update(dict.fromkeys(served, self.step))
        # What users received: with speculative decoding, known only for
        # the steps reported since the last step.
        received = served if spec is None else spec.delivered
        if self.dispatch_log:
            if spec is None:
                self.dispatch_log.record(now_ns, served)
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
            self.stats.forget_users(live)

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
        host = self._host
        host.max_num_active_reqs = min(
            host.max_num_running_reqs, host.max_num_active_reqs + 1
        )

    def admit_waiting(self, request: Request) -> bool:
        """Whether vLLM may try to admit this waiting request now."""
        if not self.modes.adapter_fits(request, self.step, self._host.running):
            return False
        if self.budget.has_budget(user_of(request)):
            return True
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
            or self._blocks_for(request.num_tokens) > self._num_free_kv_blocks()
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._host.block_size)

    def _num_free_kv_blocks(self) -> int:
        return int(self._host.kv_cache_manager.block_pool.get_num_free_blocks())

    # ----- for the engine loop, operators and observers -------------------

    def limits(self) -> dict[str, Any]:
        limiter = self.limiter
        return {DEFAULT_KEY: limiter.default_rate, USERS_KEY: limiter.user_rates}

    def update_limits(self, payload: object) -> dict[str, Any]:
        """Apply an admin change from the next step on; all or nothing."""
        update = parse_limits_update(payload)
        self.limiter.update_rates(
            default_rate=update.default_rate,
            user_rates=update.user_rates,
            remove_users=update.remove_users,
        )
        self.stats.set_named_users(self.limiter.user_rates)
        self._logger.info("Output rate limits changed: %s", self.limits())
        return self.limits()

    def snapshot(self) -> dict[str, Any]:
        return {"limits": self.limits(), "users": self.stats.snapshot()}

    def idle_wait_s(self) -> float:
        """How long the engine may wait for input before the next step.

        Non-zero only when the last step dispatched no work and some user was
        refused: then nothing can run before that user's next token is due
        (or a new request or abort arrives, which wakes the loop at once).
        """
        if not self._last_step_idle or self._wakeup_ns is None:
            return 0.0
        delay_ns = self._wakeup_ns - self.limiter.now_ns()
        return min(MAX_IDLE_WAIT_S, max(0.0, delay_ns / 1e9))
