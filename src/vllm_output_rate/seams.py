"""Every vLLM internal this plugin relies on, declared in one place.

vLLM offers ``scheduler_cls``, plugin entry points and ``additional_config``;
everything else the plugin touches is declared here, and used only through
what this module exports:

* ``SchedulerHost``: the attributes of vLLM's ``Scheduler`` that the policy
  reads and writes, and the methods our subclasses override;
* ``REQUEST_FIELDS``: the fields of vLLM's ``Request`` that the policy reads;
* ``EXPECTED_SIGNATURES``, ``REQUEST_CLASSES``, ``FUNNEL`` and
  ``API_KEY_GUARD``: what the plugin wraps, overrides, calls or reads, with
  the parameters it relies on;
* ``SOURCE_FACTS`` (kept in ``seams_facts.py``, data only): what vLLM's
  code must still do for the policy to be right;
* thin accessors (``preempt``, ``num_free_kv_blocks``, ...): how the
  policy reaches vLLM's privates.

``seams_check.py`` checks these lists against the installed vLLM (at
start-up) or a source tree (``python -m vllm_output_rate.seams DIR``). Why
each seam: docs/architecture.md, "Seams into vLLM". vLLM is imported only by
``resolve`` and for the type checker.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import SchedulerConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

# The hook a shortcut swaps for vLLM's own for one step (an instance
# attribute shadows the override).
HOOK = "_reserve_prefill_lookahead"
# The method the plugin adds to vLLM's EngineCore for the operator channel.
RPC_METHOD = "output_rate_rpc"
# Where vLLM's Scheduler lives.
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


class SeamMovedError(RuntimeError):
    """A vLLM internal this plugin relies on is gone or changed."""


class SchedulerHost:
    """The parts of vLLM's ``Scheduler`` this plugin reads and writes.

    For the type checker only (vLLM itself is not type-checked here): the
    scheduler subclasses derive from this under ``TYPE_CHECKING``, and the
    policy holds its scheduler as a ``SchedulerHost``. ``check_host`` checks
    that a real scheduler has every attribute declared here.
    """

    running: list[Request]
    waiting: RequestQueue
    requests: dict[str, Request]
    policy: SchedulingPolicy
    max_num_running_reqs: int  # --max-num-seqs
    max_num_active_reqs: int  # --max-num-active-seqs; raised per step
    finished_req_ids: set[str]
    _inflight_prefills: Collection[Request]
    kv_cache_manager: KVCacheManager
    # The step's input budget and how prefill chunks are sized (a ranked
    # step's set-aside, scheduling/set_aside.py).
    scheduler_config: SchedulerConfig
    block_size: int
    hash_block_size: int
    # Hybrid models: prefill chunks end on Mamba block boundaries.
    need_mamba_block_aligned_split: bool
    max_num_scheduled_tokens: int  # the token budget of one step
    max_model_len: int
    scheduler_reserve_full_isl: bool  # admission needs the whole prompt's KV

    # The methods the subclasses override (the bodies are vLLM's).
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        raise NotImplementedError

    def add_request(self, request: Request) -> None: ...

    def shutdown(self) -> None: ...

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        raise NotImplementedError

    # The step is settled at the first of these after schedule().
    def get_grammar_bitmask(
        self, scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        raise NotImplementedError

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        raise NotImplementedError

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None: ...

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        raise NotImplementedError

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        raise NotImplementedError

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        raise NotImplementedError

    # vLLM's own, called by the policy (see ``preempt``).
    def _preempt_request(
        self, request: Request, timestamp: float, drop_stale_output: bool = False
    ) -> None:
        raise NotImplementedError


HOST_ATTRIBUTES = tuple(SchedulerHost.__annotations__)
# The fields of vLLM's Request the policy reads (and, for arrival_time,
# moves for one step to order the queue), each set in Request.__init__.
REQUEST_FIELDS = (
    "request_id",
    "status",
    "num_computed_tokens",
    "num_output_placeholders",
    "arrival_time",
    "priority",
    "max_tokens",
    "sampling_params",
    "lora_request",
    "mm_features",
    "num_prompt_tokens",
    "client_index",  # admission: which API server sent it
)


def inflight_prefills(scheduler: SchedulerHost) -> Collection[Request]:
    """vLLM's requests whose prefill continues after this step (private)."""
    return scheduler._inflight_prefills


def preempt(scheduler: SchedulerHost, request: Request) -> None:
    """Preempt a running request the way vLLM does under KV pressure: off the
    running list, its KV blocks freed, back to the head of the waiting queue,
    to be recomputed (with prefix caching, mostly from cached blocks) when it
    is admitted again. It is reported in the step's ``preempted_req_ids``."""
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())


def num_free_kv_blocks(scheduler: SchedulerHost) -> int:
    """KV blocks vLLM can allocate now (free or evictable cached ones)."""
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def input_token_budget(scheduler: SchedulerHost) -> int:
    """Tokens one step may compute (``schedule()``'s input budget)."""
    return int(scheduler.scheduler_config.max_num_batched_tokens)


def chunks_follow_request_counts(scheduler: SchedulerHost) -> bool:
    """Whether ``schedule()`` sizes prefill chunks by how many requests run
    and wait (``--long-prefill-token-threshold``)."""
    return bool(scheduler.scheduler_config.long_prefill_token_threshold)


def num_kv_cache_groups(scheduler: SchedulerHost) -> int:
    """KV cache groups: a decoding request may take a new block in each."""
    return int(scheduler.kv_cache_manager.num_kv_cache_groups)


def kv_watermark_blocks(scheduler: SchedulerHost) -> int:
    """Blocks vLLM keeps free when it admits a waiting request."""
    return int(scheduler.kv_cache_manager.watermark_blocks)


# (module, attribute path, parameter names the wrapper relies on)
EXPECTED_SIGNATURES: list[tuple[str, str, list[str]]] = [
    ("vllm.engine.arg_utils", "EngineArgs.add_cli_args", ["parser"]),
    ("vllm.engine.arg_utils", "EngineArgs.from_cli_args", ["args"]),
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config", ["self"]),
    ("vllm.v1.engine.core", "EngineCore.post_step", ["self", "model_executed"]),
    (
        SCHEDULER_MODULE,
        "Scheduler._reserve_prefill_lookahead",
        ["self", "request", "num_computed_tokens", "num_new_tokens"],
    ),
    (
        SCHEDULER_MODULE,
        "Scheduler._handle_blocked_waiting_request",
        ["self", "request"],
    ),
    (SCHEDULER_MODULE, "Scheduler.schedule", ["self"]),
    (SCHEDULER_MODULE, "Scheduler._preempt_request", ["self", "request", "timestamp"]),
    ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", ["self"]),
    (SCHEDULER_MODULE, "Scheduler.add_request", ["self", "request"]),
    (SCHEDULER_MODULE, "Scheduler.get_grammar_bitmask", ["self", "scheduler_output"]),
    (
        SCHEDULER_MODULE,
        "Scheduler.finish_requests",
        ["self", "request_ids", "finished_status"],
    ),
    (SCHEDULER_MODULE, "Scheduler.update_draft_token_ids", ["self", "draft_token_ids"]),
    (
        SCHEDULER_MODULE,
        "Scheduler.reset_prefix_cache",
        ["self", "reset_running_requests", "reset_connector"],
    ),
    (SCHEDULER_MODULE, "Scheduler.shutdown", ["self"]),
    (
        "vllm.v1.core.sched.request_queue",
        "RequestQueue.add_request",
        ["self", "request"],
    ),
    (
        "vllm.v1.core.sched.request_queue",
        "RequestQueue.remove_requests",
        ["self", "requests"],
    ),
    ("vllm.v1.request", "Request.num_tokens", ["self"]),
    ("vllm.v1.request", "Request.num_tokens_with_spec", ["self"]),
    ("vllm.v1.request", "Request.num_output_tokens", ["self"]),
    (
        SCHEDULER_MODULE,
        "Scheduler.update_from_output",
        ["self", "scheduler_output", "model_runner_output"],
    ),
    (
        "vllm.v1.engine.core_client",
        "AsyncMPClient.call_utility_async",
        ["self", "method"],
    ),
    (
        "vllm.v1.engine.core_client",
        "AsyncMPClient.call_utility_all_async",
        ["self", "method"],
    ),
    (
        "vllm.v1.engine.async_llm",
        "AsyncLLM.check_admission",
        ["self", "n", "request_id"],
    ),
    (
        "vllm.v1.engine.async_llm",
        "AsyncLLM._record_admission_rejection",
        ["self", "reason"],
    ),
    (
        "vllm.entrypoints.serve.engine.serving",
        "BaseServing._check_model",
        ["self", "request"],
    ),
]
REQUEST_CLASSES: list[tuple[str, str]] = [
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
]
BEAM_SEARCH_CLASSES = REQUEST_CLASSES[:2]
# The API server's engine client, and the method every request goes through
# on its way into the engine core (checked with api=True).
ENGINE_CLIENT = ("vllm.v1.engine.async_llm", "AsyncLLM")
FUNNEL = "add_request"
FUNNEL_PARAMS = ["self", "request_id", "prompt", "params"]
# The engine client's methods that may send a request to the engine core,
# and the only callers each may have: everything else must go through the
# funnel. The KV-connector notice sends a request that is aborted on
# arrival (it never samples).
_ENGINE_CORE_SEND = "engine_core.add_request_async("
ENGINE_ENTRY_CALLERS: dict[str, set[str]] = {
    _ENGINE_CORE_SEND: {
        FUNNEL,
        "_add_request",
        "notify_kv_transfer_request_rejected",
    },
    "self._add_request(": {FUNNEL, "_add_streaming_input_request"},
    "self._add_streaming_input_request(": {FUNNEL},
}
# Admission (integration/admission.py): the engine client's check, replaced
# per instance, and the method that sees each API request just before it.
ADMISSION_CHECK = "check_admission"
MODEL_CHECK = ("vllm.entrypoints.serve.engine.serving", "BaseServing._check_model")
# vLLM's own --api-key middleware and the path prefixes it guards: with our
# API keys (which replace --api-key) the same paths need a valid key.
API_KEY_GUARD = ("vllm.entrypoints.serve.middleware.authenticate", "GUARDED_PREFIX")


def record_admission_rejection(engine_client: Any, reason: str) -> None:
    """Count a refusal of vLLM's global caps in vLLM's own counter."""
    engine_client._record_admission_rejection(reason)


def api_key_guarded_prefixes() -> tuple[str, ...]:
    """The path prefixes vLLM's ``--api-key`` requires a key for."""
    prefixes = resolve(*API_KEY_GUARD)
    if not (
        isinstance(prefixes, tuple)
        and prefixes
        and all(isinstance(p, str) and p.startswith("/") for p in prefixes)
    ):
        raise SeamMovedError(
            f"vllm-output-rate cannot hook into this vLLM: {'.'.join(API_KEY_GUARD)}"
            f" is {prefixes!r}, expected a tuple of path prefixes"
        )
    return prefixes


def resolve(module: str, path: str) -> Any:
    import importlib

    owner: Any = importlib.import_module(module)
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


if __name__ == "__main__":
    # ``python -m vllm_output_rate.seams [DIR]`` (``make vllm-next``).
    from vllm_output_rate.seams_check import main

    raise SystemExit(main())
