"""The rate-limiting policy of one scheduler: its long-lived state and the step.

``OutputRatePolicy`` is held by the scheduler subclasses (``scheduler.py``)
as ``scheduler.output_rate``, the one attribute this plugin adds to vLLM's
scheduler; they only forward vLLM's hooks to it. It reads and writes the
scheduler through the attributes declared in ``seams.SchedulerHost``.

It holds what lives across steps (the budget, each user's demand and last
served step, fair shares, residency, statistics) and runs each step:
``begin_step`` reserves every user's allowance in one limiter call and
makes the ``Step`` (``step.py``; planned by ``planning.py`` when
contested); vLLM schedules, calling the step's hooks; ``end_step`` records
vLLM's output and ``finish_step`` settles the step (``settling.py``).
``shortcuts.py`` layers speed-only paths over this reference path (the
``shortcuts`` setting); what operators read and change is in
``operator_view.py``. The step, walked through: docs/architecture.md,
"One scheduler step".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from vllm_output_rate.budget import Budget
from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.identity import user_or_anonymous
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling import planning, settling
from vllm_output_rate.scheduling.accounting import accounting_for
from vllm_output_rate.scheduling.demand import (
    LAST_SERVED_ATTR,
    USER_ATTR,
    Demand,
    FirstTokens,
    user_of,
)
from vllm_output_rate.scheduling.dispatch_log import DispatchLog
from vllm_output_rate.scheduling.engine_modes import EngineModes
from vllm_output_rate.scheduling.fair_share import FairShare
from vllm_output_rate.scheduling.limits_file import LimitsFileWatcher
from vllm_output_rate.scheduling.operator_view import OperatorView
from vllm_output_rate.scheduling.prompt_budget import PromptStep, prompt_demand
from vllm_output_rate.scheduling.residency import Residency
from vllm_output_rate.scheduling.shortcuts import layers_for
from vllm_output_rate.scheduling.stats import OutputRateStats
from vllm_output_rate.scheduling.step import Step, StepMode, StepRules
from vllm_output_rate.scheduling.step_budget import StepBudget
from vllm_output_rate.team_budget import SharedTeams, TeamBudget
from vllm_output_rate.teams import Teams, member_shares

if TYPE_CHECKING:
    from vllm_output_rate.seams import SchedulerHost

# Longest idle wait of the engine loop while every runnable request is
# throttled: short enough to notice other asynchronous readiness (grammar
# compilation) promptly, long enough not to spin.
MAX_IDLE_WAIT_S = 0.050


class OutputRatePolicy(OperatorView):
    # The step being scheduled, or the last one.
    step: Step
    # vLLM's own _reserve_prefill_lookahead, bound to the scheduler (set by
    # the scheduler subclass): a shortcut's stand-in for ``Step.on_chunk``.
    vllm_lookahead: Callable[[Request, int, int], int]

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
        self.host = host
        self._logger = logger
        # --max-num-active-seqs; vLLM's own attribute is raised per step.
        self.active_cap = host.max_num_active_reqs
        # Where a held-back prefill may stop, what may be admitted while
        # throttled, --max-loras (hybrid, multimodal, KV connectors, LoRA).
        self.modes = replace(
            modes or EngineModes(),
            chunked_prefill=chunked_prefill,
            prefix_caching=prefix_caching,
            hash_block_size=host.hash_block_size,
        )
        # A step's output can arrive after the next step was scheduled
        # (asynchronous scheduling, pipeline parallelism).
        self.late_outputs = late_outputs
        self.accounting = accounting_for(num_spec_tokens, late_outputs=late_outputs)
        self._rules = StepRules(host, self.accounting, self.modes, chunked_prefill)
        self.shortcuts = layers_for(settings.shortcuts, logger)
        # A fair share of each step's tokens when users' work exceeds them.
        self.share_step_tokens = settings.fair_step_tokens and chunked_prefill
        self.teams = settings.teams
        # With a shared store: what leases the teams' budget from it (set by
        # the scheduler before its first use), and that budget once leased.
        self.lease_team_budget: Callable[[Teams], SharedTeams] | None = None
        self._members_seen: object = None  # _share_within_teams
        self._shared_teams: SharedTeams | None = None
        self.use_limiter(OutputRateLimiter(settings.default_rate, settings.user_rates))
        # Prompt tokens computed per user (prompt_budget.py), when limited.
        prompt = settings.prompt_limits
        self.prompt_limiter: Budget | None = None
        if prompt is not None:
            self.use_prompt_limiter(
                OutputRateLimiter(prompt.default_rate, prompt.user_rates)
            )
        self.demand = Demand()
        # Weights and floors: who is owed service when the engine is full.
        self.fair = FairShare(settings.user_weights, settings.user_floors)
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
        # Resident slots and KV blocks for users with budget.
        self.residency = Residency()
        self.steps = 0
        # The step scheduled and not settled yet (end_step, finish_step).
        self.unsettled: Step | None = None
        # What the steps leave for the next ones (written by settling.py):
        self.user_last_served: dict[str, int] = {}
        self.order_running = False  # the last step refused or deferred someone
        self.prefilled = False  # the last step computed prompt tokens
        self.prompt_held = False  # the last step held back someone's prompt
        self.prompt_step: PromptStep | None = None  # the step's, while planned
        self.fair_growth = 0.0  # the most a user's counter grew (kept_batch.py)
        self.wakeup_ns: int | None = None  # when a refused user may sample again
        self.last_step_idle = False
        # Average time between steps (EWMA), for what a user's rate can feed.
        self._step_interval_ns = 0
        self._last_step_ns: int | None = None
        # Called by close(), e.g. to stop a shared store's refresher.
        self.on_close: list[Callable[[], None]] = []

    def use_limiter(self, limiter: Budget) -> None:
        """Account against ``limiter`` from the next step on (and against
        each member's team's budget, with teams)."""
        if self.teams is not None:
            limiter = TeamBudget(
                limiter,
                self.teams,
                shared=self._shared_team_budget(self.teams),
                changes_of=lambda: self.demand.changes,
            )
        self.limiter = limiter
        # No user can sample more tokens than requests are scheduled.
        self._max_tokens_per_step = (
            self.host.max_num_running_reqs * self.accounting.tokens_per_request
        )
        host = self.host
        limiter.attach(lambda: bool(host.requests))

    def use_teams(self, teams: Teams) -> None:
        """Charge each member to its team in ``teams`` from the next step on
        (a live change: each team keeps its place in its pacing)."""
        self.teams = teams
        if isinstance(self.limiter, TeamBudget):
            self.limiter.set_teams(teams)
        else:
            self.use_limiter(self.limiter)

    def _shared_team_budget(self, teams: Teams) -> SharedTeams | None:
        """The teams' budget leased from the shared store (started on first
        use); None without a store."""
        if self._shared_teams is None and self.lease_team_budget is not None:
            self._shared_teams = self.lease_team_budget(teams)
        return self._shared_teams

    def use_prompt_limiter(self, limiter: Budget) -> None:
        """Account prompt tokens against ``limiter`` from the next step on."""
        self.prompt_limiter = limiter
        host = self.host
        limiter.attach(lambda: bool(host.requests))

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

    def begin_step(self) -> Step:
        """Reserve the step's budget, decide its mode and plan it."""
        self.finish_step()
        host = self.host
        self.steps += 1
        if self._limits_file and self._limits_file.poll(
            self.limiter, self.fair, self.prompt_limiter, self
        ):
            self.shortcuts.forget()
            self._logger.info("Limits file reloaded: %s", self.limits_summary())
        self.accounting.give_back(self.limiter, self._logger)
        unfinished = self.demand.count_unfinished(host.finished_req_ids, host.requests)
        if self.teams is not None:
            self._share_within_teams(unfinished)
        self.limiter.between_steps(unfinished, self.demand.generation)
        if self.prompt_limiter is not None:
            # Prompt leases follow the same requests as output ones: a share
            # steady while a user has requests here (a share given back and
            # asked for again waits out the store's grace period), and an
            # engine that computes none of it reports that it uses little.
            self.prompt_limiter.between_steps(unfinished, self.demand.generation)
        budget = StepBudget(
            self.limiter,
            self.accounting.demand(unfinished, self.demand.changes),
            self._max_tokens_per_step,
        )
        crowded = planning.crowded(self)
        contested = (
            not budget.covers_demand or len(host.running) > self.active_cap or crowded
        )
        prompt = self.prompt_step = self._prompt_step()
        cuts = prompt is not None and prompt.cuts
        needs = planning.token_needs(self, budget, self.active_cap)
        shares = planning.token_shares(self, budget, needs)
        host.max_num_active_reqs = self.active_cap
        step = self.step = Step(
            self.steps,
            StepMode.CONTESTED if contested or shares or cuts else StepMode.UNCONTESTED,
            budget,
            self._rules,
            self.active_cap,
            self.active_cap,
            prompt=prompt,
        )
        # The shortcuts keep or rank batches of whole chunks: a step whose
        # chunks are cut (shared tokens, prompt rates) runs on the reference
        # path.
        if needs and shares:
            planning.plan_shared(self, step, crowded, contested, needs, shares)
        elif cuts:
            if contested:
                planning.plan_contested(self, step, crowded)
        elif not self.shortcuts.plan(self, step, crowded) and contested:
            planning.plan_contested(self, step, crowded)
        return step

    def _share_within_teams(self, unfinished: Mapping[str, int]) -> None:
        """Fair shares are hierarchical: each team weighs as its weight, and
        its floor holds for its members together, each split between its
        members with unfinished requests by their own weights (looked at
        again when users come or go, or teams change)."""
        limiter = self.limiter
        assert isinstance(limiter, TeamBudget)
        seen = (self.demand.generation, id(self.teams), id(limiter.team_of))
        if seen == self._members_seen:
            return
        self._members_seen = seen
        current = self.current_teams()
        assert current is not None
        shares = member_shares(current, self.fair.own_weight, unfinished)
        if self.fair.set_member_shares(*shares):
            self.shortcuts.forget()  # what they kept was ranked by the old

    def _prompt_step(self) -> PromptStep | None:
        """The step's prompt-token reservation, for users with a prompt rate;
        None when none is set or no prompt work is possible (the last step
        computed none, held none back, and nothing waits): plain decoding
        costs nothing."""
        limiter, host = self.prompt_limiter, self.host
        if limiter is None:
            return None
        waiting = len(host.requests) > len(host.running)
        if not (self.prefilled or waiting or self.prompt_held):
            return None
        demand, residents = prompt_demand(host.running, host.waiting if waiting else ())
        if not demand:
            return None
        return PromptStep(limiter, demand, residents, host.max_num_scheduled_tokens)

    def end_step(self, step: Step, output: SchedulerOutput) -> None:
        """vLLM scheduled ``step``: settle it now, or leave it to the next
        entry point (settling beside the model, ``shortcuts.py``)."""
        step.output = output
        step.end_ns = self.limiter.now_ns()
        self.unsettled = step
        if not self.shortcuts.settles_beside_model:
            self.finish_step()

    def finish_step(self) -> None:
        """Settle the step ``end_step`` recorded, if it is not yet. Call it
        before anything reads or changes the scheduler or this policy (it is
        cheap when done)."""
        step = self.unsettled
        if step is None:
            return
        self.unsettled = None
        settling.settle(self, step)

    def note_step_time(self, now_ns: int) -> None:
        """Keep the average time between steps (``feed_cap``)."""
        if self._last_step_ns is not None:
            interval = min(now_ns - self._last_step_ns, settling.MAX_STEP_INTERVAL_NS)
            self._step_interval_ns += (interval - self._step_interval_ns) // 8
        self._last_step_ns = now_ns

    def feed_cap(self, user: str) -> int:
        """Resident requests ``user``'s rate can feed: the most tokens its
        limit admits in one step (each request samples at most one), plus
        one stream prefilled ahead."""
        return self.limiter.tokens_within(user, self._step_interval_ns) + 1

    # ----- for the engine loop ------------------------------------------

    def idle_wait_s(self) -> float:
        """How long the engine may wait for input before the next step.

        Non-zero only when the last step dispatched no work and some user was
        refused: then nothing can run before that user's next token is due
        (or a new request or abort arrives, which wakes the loop at once).
        """
        self.finish_step()
        if not self.last_step_idle or self.wakeup_ns is None:
            return 0.0
        delay_ns = self.wakeup_ns - self.limiter.now_ns()
        return min(MAX_IDLE_WAIT_S, max(0.0, delay_ns / 1e9))
