"""vLLM V1 schedulers that enforce per-user output-token rates.

``OutputRateScheduler`` and ``OutputRateAsyncScheduler`` reuse vLLM's own
``schedule()`` unchanged and steer it through the hooks listed in
``seams.py``; every decision and all state live in the policy
(``scheduling/policy.py``), held under the one attribute they add to vLLM's
scheduler, ``output_rate``. The overrides only forward:

* ``schedule``: begin the step, run vLLM's (with vLLM's own
  ``_reserve_prefill_lookahead`` standing in for ours, as an instance
  attribute, when a shortcut runs it), undo the step's temporary changes,
  hand the output to the policy;
* ``_reserve_prefill_lookahead``, ``_handle_blocked_waiting_request``: the
  step's ``on_chunk`` and ``admit_waiting``;
* ``update_from_output``: the accounting counts what each request received
  (never the limiter); ``add_request`` tags a request with its user;
  ``shutdown`` stops a shared store's refreshers.

Every entry point settles the last step first, so no vLLM code sees the
scheduler between a step and its settling (docs/architecture.md, "Shortcuts").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.scheduling.engine_modes import EngineModes
from vllm_output_rate.scheduling.policy import OutputRatePolicy
from vllm_output_rate.seams import HOOK
from vllm_output_rate.seams_check import check_host
from vllm_output_rate.store.engine import (
    prompt_store_settings,
    start_leasing,
    team_store_settings,
)
from vllm_output_rate.store.settings import StoreSettings
from vllm_output_rate.team_budget import SharedTeams
from vllm_output_rate.teams import Teams
from vllm_output_rate.validation import OutputRateConfigError

if TYPE_CHECKING:
    from vllm_output_rate.seams import SchedulerHost as _Host
else:
    _Host = object

# Under the "vllm" logger so that vLLM's logging configuration shows it.
logger = init_logger("vllm.output_rate")


def share_limits(
    policy: OutputRatePolicy,
    settings: OutputRateSettings,
    store: StoreSettings,
    vllm_config: VllmConfig,
) -> None:
    """Lease every budget from the shared store: output tokens and, when
    set, prompt tokens and teams' output tokens (under keys of their own;
    the teams' from the first time teams are set, at start-up or later)."""
    parallel = vllm_config.parallel_config
    placement = {
        "data_parallel_rank": parallel.data_parallel_rank,
        "data_parallel_size": parallel.data_parallel_size,
        "logger": logger,
    }

    def lease_team_budget(teams: Teams) -> SharedTeams:
        limiter, refresher = start_leasing(
            # Every team has its own limit; the lowest stands in as the
            # table's default (a team removed elsewhere gets no more).
            min(teams.rates.values(), default=1.0),
            teams.rates,
            team_store_settings(store),
            budget="per-team output-token",
            members=teams.team_of,
            **placement,
        )
        policy.on_close.append(refresher.stop)
        return limiter

    policy.lease_team_budget = lease_team_budget
    limiter, refresher = start_leasing(
        settings.default_rate, settings.user_rates, store, **placement
    )
    policy.use_limiter(limiter)
    policy.on_close.append(refresher.stop)
    if (prompt := settings.prompt_limits) is not None:
        limiter, refresher = start_leasing(
            prompt.default_rate,
            prompt.user_rates,
            prompt_store_settings(store),
            budget="per-user prompt-token",
            # Prompt work comes in bursts: an engine keeps its share.
            lend_unused=False,
            **placement,
        )
        policy.use_prompt_limiter(limiter)
        policy.on_close.append(refresher.stop)


class OutputRateMixin(_Host):
    """The rate-limiting hooks; combined with vLLM's Scheduler classes below."""

    output_rate: OutputRatePolicy

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        settings = OutputRateSettings.from_additional_config(
            vllm_config.additional_config
        )
        if settings is None:
            raise OutputRateConfigError(
                f"{type(self).__name__} needs --default-user-output-tokens-per-second"
                " (or additional_config['output_rate'])"
            )
        check_host(self)
        self.output_rate = OutputRatePolicy(
            settings,
            self,
            chunked_prefill=vllm_config.scheduler_config.enable_chunked_prefill,
            prefix_caching=vllm_config.cache_config.enable_prefix_caching,
            logger=logger,
            num_spec_tokens=vllm_config.num_speculative_tokens,
            # A step's output arrives after the next step was scheduled.
            late_outputs=isinstance(self, AsyncScheduler)
            or vllm_config.parallel_config.pipeline_parallel_size > 1,
            modes=EngineModes(
                mamba_block_size=(
                    vllm_config.cache_config.block_size
                    if self.need_mamba_block_aligned_split
                    else None
                ),
                split_mm_inputs=(
                    not vllm_config.scheduler_config.disable_chunked_mm_input
                ),
                external_kv=vllm_config.kv_transfer_config is not None,
                # vLLM rewinds a seeded request's generator after a chunk
                # that does not sample; a CPU generator cannot be rewound.
                seeded_partial_prefill=(vllm_config.device_config.device_type != "cpu"),
                max_loras=(
                    vllm_config.lora_config.max_loras
                    if vllm_config.lora_config
                    else None
                ),
            ),
        )
        # vLLM's own hook, bound once: a shortcut's stand-in for ours.
        self.output_rate.vllm_lookahead = super()._reserve_prefill_lookahead
        if settings.store is not None:
            share_limits(self.output_rate, settings, settings.store, vllm_config)
        logger.info(
            "Per-user output rate limiting on: default %s tok/s, %d user "
            "override(s), --max-num-seqs %d, --max-num-active-seqs %d",
            settings.default_rate,
            len(settings.user_rates),
            self.max_num_running_reqs,
            self.output_rate.active_cap,
        )
        if settings.prompt_limits is not None:
            logger.info(
                "Per-user prompt-token rates on: default %s tok/s, %d user override(s)",
                settings.prompt_limits.default_rate,
                len(settings.prompt_limits.user_rates),
            )

    def shutdown(self) -> None:
        self.output_rate.finish_step()
        self.output_rate.close()
        super().shutdown()

    def add_request(self, request: Request) -> None:
        self.output_rate.finish_step()
        self.output_rate.tag(request)
        super().add_request(request)
        self.output_rate.added(request)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        policy = self.output_rate
        step = policy.begin_step()
        if step.vllm_hook:
            self.__dict__[HOOK] = policy.vllm_lookahead
        try:
            output = super().schedule(throttle_prefills)
        finally:
            if step.vllm_hook:
                del self.__dict__[HOOK]
            step.undo()
        policy.end_step(step, output)
        return output

    def get_grammar_bitmask(
        self, scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        self.output_rate.finish_step()
        return super().get_grammar_bitmask(scheduler_output)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        self.output_rate.finish_step()
        return super().finish_requests(request_ids, finished_status)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        self.output_rate.finish_step()
        super().update_draft_token_ids(draft_token_ids)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.output_rate.finish_step()
        return super().reset_prefix_cache(reset_running_requests, reset_connector)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        self.output_rate.finish_step()
        # Bookkeeping only (what each request received), never the limiter.
        accounting = self.output_rate.accounting
        accounting.before_report(scheduler_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        accounting.reported(scheduler_output)
        return outputs

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        return self.output_rate.step.on_chunk(
            request, num_computed_tokens, num_new_tokens
        )

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        return self.output_rate.step.admit_waiting(request)


class OutputRateScheduler(OutputRateMixin, Scheduler):
    """vLLM's synchronous V1 scheduler with per-user output rate limits."""


class OutputRateAsyncScheduler(OutputRateMixin, AsyncScheduler):
    """vLLM's asynchronous V1 scheduler with per-user output rate limits."""
