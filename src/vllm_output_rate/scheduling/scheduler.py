"""vLLM V1 schedulers that enforce per-user output-token rates.

The subclasses reuse vLLM's own ``schedule()`` unchanged and steer it through
three narrow hooks (listed in ``integration/seams.py`` and guarded by tests):

* ``_reserve_prefill_lookahead`` runs for every request right after vLLM has
  decided how many tokens to compute for it in this step. If that chunk
  reaches the end of the sequence, the step samples a token: we charge the
  user's budget here. Without budget we hold the chunk back by one position
  (chunked prefill) or return 0, which makes vLLM skip the request while it
  keeps its KV blocks and its place in ``running``.
* ``_handle_blocked_waiting_request`` lets a waiting request that could only
  run by sampling stay in the queue (skipped, order kept) when its user has
  no budget, so it never stops other users' requests behind it.
* ``max_num_active_reqs`` is raised for the step by the number of resident
  requests skipped for lack of budget, so they do not hold active slots,
  while ``max_num_running_reqs`` (--max-num-seqs) still bounds residency.

Each step starts by reserving every user's allowance, sized to its
unfinished requests (a request samples at most one token per step). When
every reservation is whole and no active slot is contested, nobody can be
refused: the step runs as stock vLLM's, without our per-request hook, and
the sampled tokens are charged afterwards in one C-level pass (the fast
path; scheduler overhead is then within a few percent of stock). Otherwise
the running list may be reordered before the step (throttled requests last,
a user's streams rotated, active slots shared round-robin between users) and
the hook decides request by request. At the end one refund returns every
token reserved or charged but not dispatched. ``update_from_output`` never
touches the limiter, which keeps asynchronous scheduling possible.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from itertools import filterfalse
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.config import (
    DEFAULT_KEY,
    USERS_KEY,
    OutputRateConfigError,
    OutputRateSettings,
    parse_limits_update,
)
from vllm_output_rate.identity import user_or_anonymous
from vllm_output_rate.integration.compat import check_supported_config
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling.dispatch_log import DispatchLog
from vllm_output_rate.scheduling.limits_file import LimitsFileWatcher
from vllm_output_rate.scheduling.ordering import fair_order, rotate_within_groups
from vllm_output_rate.scheduling.stats import OutputRateStats
from vllm_output_rate.scheduling.step_budget import StepBudget

# Under the "vllm" logger so that vLLM's logging configuration shows it.
logger = init_logger("vllm.output_rate")

# Longest idle wait of the engine loop while every runnable request is
# throttled: short enough to notice other asynchronous readiness (grammar
# compilation) promptly, long enough not to spin.
MAX_IDLE_WAIT_S = 0.050
# Forget idle users' limiter state this often (in steps).
CLEANUP_EVERY_STEPS = 256
# Per-request attributes this plugin keeps on vLLM's Request objects.
USER_ATTR = "output_rate_user"
LAST_SERVED_ATTR = "output_rate_last_served_step"


def _user_of(request: Request) -> str:
    return getattr(request, USER_ATTR)


def _last_served_of(request: Request) -> int:
    return getattr(request, LAST_SERVED_ATTR)


# For map() and filter(): the per-request passes of the fast path then run in
# C, without a Python call per request.
_users_of = attrgetter(USER_ATTR)
_is_prefill_chunk = attrgetter("is_prefill_chunk")
# An empty, read-only count: building a Counter costs microseconds per step.
NOTHING: Mapping[str, int] = MappingProxyType({})


class OutputRateMixin:
    """The rate-limiting policy; combined with vLLM's Scheduler classes below."""

    # Attributes of vLLM's Scheduler that the mixin reads (for type checkers).
    running: list[Request]
    waiting: Any
    policy: SchedulingPolicy
    max_num_running_reqs: int
    max_num_active_reqs: int
    hash_block_size: int
    block_size: int
    kv_cache_manager: Any

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)  # type: ignore[call-arg]
        settings = OutputRateSettings.from_additional_config(
            vllm_config.additional_config
        )
        if settings is None:
            raise OutputRateConfigError(
                f"{type(self).__name__} needs --default-user-output-tokens-per-second"
                " (or additional_config['output_rate'])"
            )
        check_supported_config(vllm_config)
        self.output_rate_settings = settings
        # --max-num-active-seqs; vLLM's own attribute is raised per step.
        self.output_rate_active_cap = self.max_num_active_reqs
        self._chunked_prefill = vllm_config.scheduler_config.enable_chunked_prefill
        self._prefix_caching = vllm_config.cache_config.enable_prefix_caching
        self.use_limiter(OutputRateLimiter(settings.default_rate, settings.user_rates))
        self._step = 0
        self._user_last_served: dict[str, int] = {}
        self._charged: dict[str, Request] = {}  # request id -> request, this step
        self._active_in_step = 0
        # Active slots the running requests may fill in this step.
        self._running_cap = self.output_rate_active_cap
        self._engaged = False  # someone was throttled or the active cap binds
        self._wakeup_ns: int | None = None
        self._last_step_idle = False
        # Resident requests skipped for lack of budget in the last step.
        self.output_rate_throttled: list[Request] = []
        # Each unfinished request's user, and their count per user: the
        # step's demand, kept up to date without a pass over the requests.
        self._user_by_id: dict[str, str] = {}
        # A plain dict, not a Counter: Counter's == is a Python-level method,
        # and this one is compared every step.
        self._unfinished: dict[str, int] = {}
        # vLLM's own hook, bound once: the fast path's stand-in for ours.
        self._stock_hook = super()._reserve_prefill_lookahead  # type: ignore[misc]
        self._dispatch_log = DispatchLog.from_env()
        self.output_rate_stats = OutputRateStats(settings.user_rates)
        self._limits_file = (
            LimitsFileWatcher(settings.config_file, logger.warning)
            if settings.config_file
            else None
        )
        logger.info(
            "Per-user output rate limiting on: default %s tok/s, %d user "
            "override(s), --max-num-seqs %d, --max-num-active-seqs %d",
            settings.default_rate,
            len(settings.user_rates),
            self.max_num_running_reqs,
            self.output_rate_active_cap,
        )

    # ----- configuration ------------------------------------------------

    def use_limiter(self, limiter: OutputRateLimiter) -> None:
        """Account against ``limiter`` from the next step on."""
        self.output_rate_limiter = limiter
        self._budget = StepBudget(limiter, self.max_num_running_reqs)

    # ----- requests -----------------------------------------------------

    def add_request(self, request: Request) -> None:
        # Parse the identity once; every step reads the cached attribute.
        params = request.sampling_params
        setattr(
            request,
            USER_ATTR,
            user_or_anonymous(params.extra_args if params is not None else None),
        )
        setattr(request, LAST_SERVED_ATTR, -1)
        super().add_request(request)  # type: ignore[misc]
        if request.request_id not in self._user_by_id:
            user = _user_of(request)
            self._user_by_id[request.request_id] = user
            self._unfinished[user] = self._unfinished.get(user, 0) + 1

    # ----- the step -----------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._step += 1
        if self._limits_file and self._limits_file.poll(self.output_rate_limiter):
            self.output_rate_stats.set_named_users(self.output_rate_limiter.user_rates)
            logger.info("Limits file reloaded: %s", self.output_rate_limits())
        # A request samples at most one token per step, so a user's
        # unfinished requests bound what it can take in this one.
        everyone_covered = self._budget.begin_step(self._count_unfinished())
        self._charged.clear()
        self._active_in_step = 0
        self._running_cap = self.output_rate_active_cap
        self.output_rate_throttled = []
        self.max_num_active_reqs = self.output_rate_active_cap
        # Fast path: nobody can be refused and no active slot is contested,
        # so the step is stock vLLM's. vLLM's own hook then runs in place of
        # ours (an instance attribute shadows the override for this step)
        # and the dispatched tokens are charged afterwards in one pass, which
        # saves a Python call per request.
        fast = everyone_covered and len(self.running) <= self.output_rate_active_cap
        moved_arrivals = self._plan_step() if self._engaged and not fast else {}
        if fast:
            self.__dict__["_reserve_prefill_lookahead"] = self._stock_hook
        try:
            output = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            if fast:
                del self.__dict__["_reserve_prefill_lookahead"]
            self.max_num_active_reqs = self.output_rate_active_cap
            self._restore_arrivals(moved_arrivals)
        if fast:
            served, undispatched = self._charge_dispatched(output), NOTHING
        else:
            served, undispatched = self._sort_charged(output)
        self._settle(output, served, undispatched)
        return output

    def _count_unfinished(self) -> dict[str, int]:
        """Unfinished requests per user, updated from vLLM's ids of requests
        finished since the last step (O(finished), not O(requests): a pass
        over thousands of cache-cold requests showed in the step time).

        Every request enters through ``add_request``, so the map can only
        hold too many ids, never too few; equal sizes mean it is exact, and
        otherwise (a request left some other way) it is rebuilt.
        """
        users, unfinished = self._user_by_id, self._unfinished
        for request_id in self.finished_req_ids:  # type: ignore[attr-defined]
            user = users.pop(request_id, None)
            if user is not None:
                unfinished[user] -= 1
                if not unfinished[user]:
                    del unfinished[user]
        if len(users) != len(self.requests):  # type: ignore[attr-defined]
            self._recount_unfinished()
        return self._unfinished

    def _recount_unfinished(self) -> None:
        requests = self.requests  # type: ignore[attr-defined]
        self._user_by_id = {rid: _user_of(r) for rid, r in requests.items()}
        self._unfinished = dict(Counter(self._user_by_id.values()))

    def _plan_step(self) -> dict[Request, float]:
        """Order the running list for this step; see the module docstring."""
        budget = self._budget
        ready = [r for r in self.running if budget.has_budget(_user_of(r))]
        throttled = [r for r in self.running if _user_of(r) in budget.refused_users]
        priority = self.policy == SchedulingPolicy.PRIORITY
        if len(ready) >= self.output_rate_active_cap:
            # Active slots are contested. A user waiting at the head of the
            # queue with nothing resident has been served least recently of
            # all: keep one slot for it rather than let resident users fill
            # every slot forever.
            if self.waiting and _user_of(self.waiting.peek_request()) not in {
                _user_of(r) for r in ready
            }:
                self._running_cap = self.output_rate_active_cap - 1
            ready = fair_order(
                ready,
                _user_of,
                _last_served_of,
                self._user_last_served,
                priority_of=(lambda r: r.priority) if priority else None,
            )
        else:
            ready = rotate_within_groups(
                ready,
                (lambda r: (_user_of(r), r.priority)) if priority else _user_of,
                _last_served_of,
            )
        # FCFS preempts the last running request: make that a throttled one.
        self.running[:] = ready + throttled
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
            self.waiting.remove_requests(preempted)
            for request in preempted:
                self.waiting.add_request(request)

    def _charge_dispatched(self, output: SchedulerOutput) -> Mapping[str, int]:
        """Fast path: charge each user the sampling chunks dispatched."""
        served = self._count_sampled(output.num_scheduled_tokens)
        if not self._budget.spend_counts(served):
            logger.warning("A step dispatched more tokens than it reserved: %s", served)
        return served

    def _count_sampled(self, scheduled: Mapping[str, int]) -> Mapping[str, int]:
        """Sampled tokens per user among the requests scheduled in the step
        (read-only: it may be the live count of unfinished requests).

        A chunk that did not reach the end of the sequence samples nothing.
        vLLM keeps such requests in ``_inflight_prefills`` until their last
        chunk; when it is empty (steady decoding), every scheduled request
        sampled and the count needs only request ids, not a touch of each
        (cache-cold) request. Otherwise each scheduled request's
        ``is_prefill_chunk``, set by vLLM after scheduling, decides: the same
        test the hook applies before dispatch.
        """
        if not self._inflight_prefills:  # type: ignore[attr-defined]
            if len(scheduled) == len(self._user_by_id):
                # Every unfinished request was scheduled (the map is exact
                # after _count_unfinished): each user sampled its demand.
                return self._unfinished
            served = Counter(map(self._user_by_id.get, scheduled))
            if None not in served:
                return served  # type: ignore[return-value]
        requests = self.requests  # type: ignore[attr-defined]
        return Counter(
            map(
                _users_of,
                filterfalse(_is_prefill_chunk, map(requests.__getitem__, scheduled)),
            )
        )

    def _sort_charged(
        self, output: SchedulerOutput
    ) -> tuple[Counter[str], Counter[str]]:
        """Split the tokens the hook charged into dispatched and not."""
        scheduled = output.num_scheduled_tokens
        served: Counter[str] = Counter()
        undispatched: Counter[str] = Counter()
        for request_id, request in self._charged.items():
            if request_id in scheduled:
                setattr(request, LAST_SERVED_ATTR, self._step)
                served[_user_of(request)] += 1
            else:
                undispatched[_user_of(request)] += 1
        return served, undispatched

    def _settle(
        self,
        output: SchedulerOutput,
        served: Mapping[str, int],
        undispatched: Mapping[str, int],
    ) -> None:
        """The single refund point, plus bookkeeping for the next step."""
        now_ns = self.output_rate_limiter.now_ns()
        self._user_last_served.update(dict.fromkeys(served, self._step))
        if self._dispatch_log:
            self._dispatch_log.record(now_ns, served)
        self._wakeup_ns = self._budget.settle(undispatched)
        self.output_rate_stats.record_step(
            now_ns,
            served,
            undispatched,
            Counter(map(_users_of, self.output_rate_throttled))
            if self.output_rate_throttled
            else NOTHING,
        )
        self._last_step_idle = output.total_num_scheduled_tokens == 0
        self._engaged = bool(self._budget.refused_users) or (
            len(self.running) > self.output_rate_active_cap
        )
        if self._step % CLEANUP_EVERY_STEPS == 0:
            self.output_rate_limiter.cleanup_idle_users()
            live = {_user_of(r) for r in self.running}
            self._user_last_served = {
                u: s for u, s in self._user_last_served.items() if u in live
            }
            self.output_rate_stats.forget_users(live)

    # ----- hooks called by vLLM's schedule() -----------------------------

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens
        )
        if num_new_tokens <= 0:
            return num_new_tokens
        in_running_loop = request.status == RequestStatus.RUNNING
        user = _user_of(request)
        samples = (
            num_computed_tokens + num_new_tokens
            >= request.num_tokens + request.num_output_placeholders
            and request.request_id not in self._charged  # never charge twice
        )
        if samples and not self._budget.has_budget(user):
            # No budget: compute the prompt up to the sampling position only.
            held_back = (
                request.num_tokens
                + request.num_output_placeholders
                - 1
                - num_computed_tokens
            )
            if not (self._chunked_prefill and held_back > 0):
                if in_running_loop:
                    # Skipped: it keeps its KV blocks and worker slot but
                    # gives its active slot to a waiting request.
                    self.output_rate_throttled.append(request)
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
            self._budget.spend(user)
            self._charged[request.request_id] = request
        return num_new_tokens

    def _raise_admission_cap(self) -> None:
        """Let a resident request that is skipped in this step not count.

        vLLM admits a waiting request while ``len(running)`` is below
        ``max_num_active_reqs``; each skipped resident request raises that
        bar by one, never beyond ``--max-num-seqs`` (the worker slots).
        """
        self.max_num_active_reqs = min(
            self.max_num_running_reqs, self.max_num_active_reqs + 1
        )

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):  # type: ignore[misc]
            return False
        if self._budget.has_budget(_user_of(request)):
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
            self._may_only_run_by_sampling(request)
            or request.status == RequestStatus.PREEMPTED
            or self._blocks_for(request.num_tokens) > self._num_free_kv_blocks()
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_free_kv_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _may_only_run_by_sampling(self, request: Request) -> bool:
        if not self._chunked_prefill:
            return True  # the whole prompt runs at once and samples
        if request.num_tokens - request.num_computed_tokens <= 1:
            return True
        # A prefix-cache hit stops at a block boundary and at most one token
        # before the end; when that boundary is the last token, only the
        # sampling position is left to compute.
        return (
            self._prefix_caching
            and request.num_computed_tokens == 0
            and (request.num_tokens - 1) % self.hash_block_size == 0
        )

    # ----- for the engine loop, operators and observers -------------------

    def output_rate_limits(self) -> dict[str, Any]:
        limiter = self.output_rate_limiter
        return {DEFAULT_KEY: limiter.default_rate, USERS_KEY: limiter.user_rates}

    def output_rate_update_limits(self, payload: object) -> dict[str, Any]:
        """Apply an admin change from the next step on; all or nothing."""
        update = parse_limits_update(payload)
        self.output_rate_limiter.update_rates(
            default_rate=update.default_rate,
            user_rates=update.user_rates,
            remove_users=update.remove_users,
        )
        self.output_rate_stats.set_named_users(self.output_rate_limiter.user_rates)
        logger.info("Output rate limits changed: %s", self.output_rate_limits())
        return self.output_rate_limits()

    def output_rate_snapshot(self) -> dict[str, Any]:
        return {
            "limits": self.output_rate_limits(),
            "users": self.output_rate_stats.snapshot(),
        }

    def output_rate_idle_wait_s(self) -> float:
        """How long the engine may wait for input before the next step.

        Non-zero only when the last step dispatched no work and some user was
        refused: then nothing can run before that user's next token is due
        (or a new request or abort arrives, which wakes the loop at once).
        """
        if not self._last_step_idle or self._wakeup_ns is None:
            return 0.0
        delay_ns = self._wakeup_ns - self.output_rate_limiter.now_ns()
        return min(MAX_IDLE_WAIT_S, max(0.0, delay_ns / 1e9))


class OutputRateScheduler(OutputRateMixin, Scheduler):
    """vLLM's synchronous V1 scheduler with per-user output rate limits."""


class OutputRateAsyncScheduler(OutputRateMixin, AsyncScheduler):
    """vLLM's asynchronous V1 scheduler with per-user output rate limits."""
