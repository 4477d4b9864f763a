"""Every vLLM internal this plugin relies on, in one module, checked.

vLLM offers ``scheduler_cls``, plugin entry points and
``additional_config``; everything else the plugin needs is listed here: the
methods it wraps or overrides (with the parameters it relies on), the facts
about vLLM's source it relies on, and the scheduler attributes it reads and
writes (``SchedulerHost``). ``verify_seams()`` runs when the plugin loads
and in the tests, and ``check_host()`` when our scheduler starts, so a vLLM
upgrade that moves one fails loudly instead of silently turning limiting
off. The same lists are checked against a vLLM source tree that is never
imported (``python -m vllm_output_rate.seams DIR``, ``make vllm-next``: a
release that cannot run here). This module imports vLLM only inside those
checks; the scheduling policy and the integration both import it, and it
imports neither.

Wrapped by the plugin (``integration/plugin.py``), in the process where vLLM
calls them:

* ``EngineArgs.add_cli_args``: adds the plugin's flags to vLLM's parser.
* ``EngineArgs.from_cli_args``: carries the flags into
  ``additional_config``.
* ``EngineArgs.create_engine_config``: validates and selects our scheduler.
* ``EngineCore.post_step``: waits on the input queue while all is throttled.
* ``EngineCore.output_rate_rpc`` (added): the engine-side method that the
  HTTP plugin reaches through vLLM's utility-call channel
  (``call_utility_async``), to read statistics and change limits.
* ``ChatCompletionRequest/CompletionRequest/ResponsesRequest
  .to_sampling_params`` and ``.to_beam_search_params``: HTTP 400 for a
  malformed ``output_rate_user`` and for beam search.
* ``AsyncLLM.add_request`` (wrapped per instance by the HTTP plugin): the
  one funnel every route's request goes through into the engine; trusted
  identity stamps the verified user there or refuses the request, and the
  user is validated there for every route. ``verify_seams`` checks that
  every path of ``AsyncLLM`` into the engine core passes through it (in the
  installed vLLM; a source tree is not imported, so not there), and reads
  the path prefixes vLLM's own ``--api-key`` guards.

Overridden by the scheduler subclasses (``integration/scheduler.py``):
``schedule``, ``add_request``, ``shutdown`` (a shared store's refresher),
``get_grammar_bitmask`` (the step is settled there: ``EngineCore.step``
calls it after handing the step to the worker and before waiting for the
output, so the settling overlaps the model; a source fact below checks the
call, whose place decides only where the time goes, not what is charged),
``finish_requests``, ``update_draft_token_ids`` and ``reset_prefix_cache``
(each settles the step first, as every override does),
``update_from_output`` (speculative decoding: what each request of the
reported step received, from ``Request._output_token_ids``; never a limiter
call) and the private ``_reserve_prefill_lookahead`` and
``_handle_blocked_waiting_request``; the attribute ``max_num_active_reqs``
is read by vLLM's waiting loop. The shortcuts (``scheduling/shortcuts.py``)
rely on two more facts: ``schedule()`` looks the hook up on ``self`` at each
call (so an instance attribute can stand in for the override during a step),
and ``_update_after_schedule`` sets ``Request.is_prefill_chunk`` on every
scheduled request before ``schedule()`` returns (so the step's sampled
tokens can be counted afterwards). A kept step
(``scheduling/kept_batch.py``) is served whole, so none of its requests may
be one that ``schedule()`` passes over before the hook
(``passed_over_next_step``); it sets the running requests beyond its batch
aside, off ``running`` for the duration of ``schedule()``, which serves
running requests only from that list and preempts, when a KV block cannot be
had, only from it (so the policy first checks that every request of the
batch finds a block in each of ``kv_cache_manager``'s
``num_kv_cache_groups``). Each step's demand is kept from
``Scheduler.finished_req_ids`` (filled by ``_free_request``, read before
``schedule()`` clears it), with a recount whenever it disagrees with
``Scheduler.requests``; and when vLLM's ``_inflight_prefills`` (requests
whose prefill continues after this step) is empty, every scheduled request
sampled. Engine modes: a waiting request's draft positions are ``-1``
padding (charged one token); hybrid models align prefill chunks to Mamba
blocks (``need_mamba_block_aligned_split``); the idle wait is skipped while
``EngineCore.batch_queue`` holds batches.

So that a throttled user never locks others out
(``scheduling/residency.py``) the policy preempts throttled residents with
vLLM's own recompute preemption, ``Scheduler._preempt_request`` (the request
goes back to the head of ``waiting`` and frees its KV blocks; the caller
takes it off ``running``, as vLLM's own callers do), reads the free KV
blocks (``kv_cache_manager.block_pool.get_num_free_blocks()``, the watermark
``kv_cache_manager.watermark_blocks``, ``scheduler_reserve_full_isl``,
``max_num_scheduled_tokens``), and closes the waiting scan for a step by
setting ``max_num_active_reqs`` to 0 (vLLM stops admitting once
``len(running)`` reaches it).

Over 400 lines on purpose: every touch of a vLLM internal is listed here, in
one place, with its check; how a source tree is read is in
``vllm_source.py``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_output_rate.vllm_source import LiveSource, Source, StaticSource, vllm_imports

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
    # step's set-aside, scheduling/shortcuts.py).
    scheduler_config: SchedulerConfig
    block_size: int
    hash_block_size: int
    # Hybrid models: prefill chunks end on Mamba block boundaries.
    need_mamba_block_aligned_split: bool
    max_num_scheduled_tokens: int  # the token budget of one step
    max_model_len: int
    scheduler_reserve_full_isl: bool  # admission needs the whole prompt's KV
    current_step: int  # counted by schedule(), first thing

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
    "next_decode_eligible_step",
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


def passed_over_next_step(scheduler: SchedulerHost, request: Request) -> bool:
    """Whether vLLM's running loop will pass a running ``request`` over in
    the next ``schedule()`` before sizing a chunk for it (so the hook never
    sees it): with asynchronous scheduling once its last token is scheduled
    (``num_output_placeholders``), with pipeline parallelism until its next
    decode is eligible. Call it before ``schedule()``, which first counts
    ``current_step`` up."""
    return bool(
        (
            request.num_output_placeholders > 0
            and request.num_computed_tokens + 2 - request.num_output_placeholders
            >= request.num_prompt_tokens + request.max_tokens
        )
        or scheduler.current_step + 1 < request.next_decode_eligible_step
    )


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


def check_host(scheduler: object) -> None:
    """Raise SeamMovedError unless ``scheduler`` has every declared attribute."""
    missing = [name for name in HOST_ATTRIBUTES if not hasattr(scheduler, name)]
    if missing:
        raise SeamMovedError(
            "vllm-output-rate cannot hook into this vLLM: its Scheduler has no "
            + ", ".join(missing)
        )


# (module, attribute path, parameter names the wrapper relies on)
EXPECTED_SIGNATURES: list[tuple[str, str, list[str]]] = [
    ("vllm.engine.arg_utils", "EngineArgs.add_cli_args", ["parser"]),
    ("vllm.engine.arg_utils", "EngineArgs.from_cli_args", ["args"]),
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config", ["self"]),
    ("vllm.v1.engine.core", "EngineCore.post_step", ["self", "model_executed"]),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._reserve_prefill_lookahead",
        ["self", "request", "num_computed_tokens", "num_new_tokens"],
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._handle_blocked_waiting_request",
        ["self", "request"],
    ),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ["self"]),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._preempt_request",
        ["self", "request", "timestamp"],
    ),
    ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", ["self"]),
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ["self", "request"]),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.get_grammar_bitmask",
        ["self", "scheduler_output"],
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.finish_requests",
        ["self", "request_ids", "finished_status"],
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_draft_token_ids",
        ["self", "draft_token_ids"],
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.reset_prefix_cache",
        ["self", "reset_running_requests", "reset_connector"],
    ),
    ("vllm.v1.core.sched.scheduler", "Scheduler.shutdown", ["self"]),
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
    ("vllm.v1.request", "Request.num_output_tokens", ["self"]),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_from_output",
        ["self", "scheduler_output", "model_runner_output"],
    ),
    (
        "vllm.v1.engine.core_client",
        "AsyncMPClient.call_utility_async",
        ["self", "method"],
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
# vLLM's own --api-key middleware and the path prefixes it guards: with our
# API keys (which replace --api-key) the same paths need a valid key.
API_KEY_GUARD = ("vllm.entrypoints.serve.middleware.authenticate", "GUARDED_PREFIX")

_SCHEDULER = "vllm.v1.core.sched.scheduler"
# Facts about vLLM's source the plugin relies on: (module, function, text
# its source must contain, the fact).
SOURCE_FACTS: list[tuple[str, str, str, str]] = [
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self.max_num_active_reqs",
        "Scheduler.schedule reads max_num_active_reqs",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self._reserve_prefill_lookahead(",
        "Scheduler.schedule calls self._reserve_prefill_lookahead",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self._update_after_schedule(",
        "Scheduler.schedule calls self._update_after_schedule",
    ),
    (
        _SCHEDULER,
        "Scheduler._update_after_schedule",
        "request.is_prefill_chunk =",
        "Scheduler._update_after_schedule sets Request.is_prefill_chunk",
    ),
    (
        _SCHEDULER,
        "Scheduler._update_after_schedule",
        "self._inflight_prefills.discard(",
        "Scheduler._update_after_schedule drops finished prefills from "
        "_inflight_prefills",
    ),
    (
        _SCHEDULER,
        "Scheduler._free_request",
        "self.finished_req_ids.add(",
        "Scheduler._free_request records finished_req_ids",
    ),
    # A ranked step that sets its deferred requests aside (shortcuts.py)
    # checks the step's input budget and how prefill chunks are sized.
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self.scheduler_config.max_num_batched_tokens",
        "Scheduler.schedule's input budget is max_num_batched_tokens",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self.scheduler_config.long_prefill_token_threshold",
        "Scheduler.schedule sizes prefill chunks by long_prefill_token_threshold",
    ),
    # A kept batch is served whole (scheduling/shortcuts.py).
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self.current_step += 1",
        "Scheduler.schedule counts current_step up first",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "request.num_computed_tokens + 2 - request.num_output_placeholders",
        "Scheduler.schedule passes over a request whose last token is scheduled",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "self.current_step < request.next_decode_eligible_step",
        "Scheduler.schedule passes over a request not yet eligible to decode",
    ),
    # Lock-out rules (scheduling/residency.py).
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "if num_running >= self.max_num_active_reqs:",
        "Scheduler.schedule stops admitting at max_num_active_reqs",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "full_sequence_must_fit=self.scheduler_reserve_full_isl",
        "Scheduler.schedule admits only what scheduler_reserve_full_isl fits",
    ),
    (
        _SCHEDULER,
        "Scheduler._preempt_request",
        "self._free_request_blocks(request)",
        "Scheduler._preempt_request frees the request's KV blocks",
    ),
    (
        _SCHEDULER,
        "Scheduler._preempt_request",
        "self.waiting.prepend_request(request)",
        "Scheduler._preempt_request puts the request back into waiting",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "while req_index < len(self.running)",
        "Scheduler.schedule serves the running requests from self.running",
    ),
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "preempted_req = self.running.pop()",
        "Scheduler.schedule preempts the last request of self.running",
    ),
    (
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager.__init__",
        "self.num_kv_cache_groups =",
        "KVCacheManager counts its KV cache groups",
    ),
    (
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager.allocate_slots",
        "self.watermark_blocks",
        "KVCacheManager.allocate_slots keeps watermark_blocks free",
    ),
    # Speculative decoding (scheduling/speculative.py).
    (
        _SCHEDULER,
        "Scheduler.schedule",
        "] * self.num_spec_tokens",
        "Scheduler.schedule pads a waiting request's drafts with -1, which "
        "the rejection sampler always rejects",
    ),
    (
        _SCHEDULER,
        "Scheduler._update_request_with_output",
        "request.append_output_token_ids(",
        "update_from_output appends a step's tokens to the request's output",
    ),
    (
        "vllm.v1.request",
        "Request.num_output_tokens",
        "len(self._output_token_ids)",
        "Request.num_output_tokens counts the tokens of its output",
    ),
    # Seeded requests on CPU (scheduling/engine_modes.py).
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._bookkeeping_sync",
        "gen.set_offset(",
        "vLLM rewinds a seeded request's generator after a chunk that does "
        "not sample (which a CPU generator cannot)",
    ),
    # The idle wait (integration/engine_loop.py).
    (
        "vllm.v1.engine.core",
        "EngineCore.__init__",
        "self.batch_queue",
        "EngineCore keeps its batches in flight in batch_queue",
    ),
    # Where a step is settled while the model runs (integration/scheduler.py).
    (
        "vllm.v1.engine.core",
        "EngineCore.step",
        "self.scheduler.get_grammar_bitmask(scheduler_output)",
        "EngineCore.step asks the scheduler for the step's grammar bitmask "
        "while the worker runs the step",
    ),
]
# Every `from vllm... import name` of this package must resolve.
PACKAGE_DIR = Path(__file__).parent


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


def seam_problems(
    source: Source,
    *,
    api: bool = True,
    imports: bool = True,
    also_imports_of: tuple[str | Path, ...] = (),
) -> list[str]:
    """Every internal this plugin relies on that ``source`` lacks or changed.

    ``api=False`` skips the OpenAI request classes (engine processes never
    import the API server); ``imports=False`` skips checking that every vLLM
    name this package imports exists (at start-up Python checks the ones
    it needs as it imports them); ``also_imports_of`` adds folders whose
    vLLM imports must resolve too (the tests).
    """
    problems = []
    init = source.function(_SCHEDULER, "Scheduler.__init__")
    for name in HOST_ATTRIBUTES:
        # Assigned (perhaps annotated) in vLLM's Scheduler.__init__.
        if init is None or not any(
            f"self.{name}{end}" in init.source for end in (" =", ":")
        ):
            problems.append(f"no longer true: Scheduler keeps {name}")
    request_init = source.function("vllm.v1.request", "Request.__init__")
    for name in REQUEST_FIELDS:
        if request_init is None or not any(
            f"self.{name}{end}" in request_init.source for end in (" =", ":")
        ):
            problems.append(f"no longer true: Request keeps {name}")
    for module, path, params in EXPECTED_SIGNATURES:
        function = source.function(module, path)
        if function is None:
            problems.append(f"{module}.{path} no longer exists")
            continue
        names = function.params
        if params not in (names[: len(params)], names[1 : len(params) + 1]):
            problems.append(f"{module}.{path}{tuple(names)} expected {params}")
    methods = [(cls, "to_sampling_params") for cls in REQUEST_CLASSES]
    methods += [(cls, "to_beam_search_params") for cls in BEAM_SEARCH_CLASSES]
    for (module, name), method in methods if api else []:
        if source.function(module, f"{name}.{method}") is None:
            problems.append(f"{module}.{name}.{method} no longer exists")
    for module, path, needle, fact in SOURCE_FACTS:
        function = source.function(module, path)
        if function is None or needle not in function.source:
            problems.append(f"no longer true: {fact}")
    if api and isinstance(source, LiveSource):
        problems += _funnel_problems()
        try:
            api_key_guarded_prefixes()
        except (ImportError, AttributeError):
            problems.append(f"{'.'.join(API_KEY_GUARD)} no longer exists")
        except SeamMovedError as exc:
            problems.append(str(exc))
    for need in vllm_imports(PACKAGE_DIR, *also_imports_of) if imports else []:
        if not any(
            all(
                source.defines(module, name) if name else source.has_module(module)
                for module, name in option
            )
            for option in need.options
        ):
            problems.append(need.describe())
    return problems


def verify_seams(
    *, api: bool = True, imports: bool = False, source: Source | None = None
) -> None:
    """Raise SeamMovedError naming every internal that is gone or changed
    (in the installed vLLM unless ``source`` says otherwise)."""
    problems = seam_problems(source or LiveSource(), api=api, imports=imports)
    if problems:
        raise SeamMovedError(
            "vllm-output-rate cannot hook into this vLLM: " + "; ".join(problems)
        )


def _funnel_problems() -> list[str]:
    """Every path of the engine client into the engine core goes through
    ``FUNNEL`` (so that no route can bypass trusted identity)."""
    module, name = ENGINE_CLIENT
    where = f"{module}.{name}"
    try:
        client = resolve(module, name)
        funnel = getattr(client, FUNNEL)
    except (ImportError, AttributeError):
        return [f"{where}.{FUNNEL} no longer exists"]
    problems = []
    names = list(inspect.signature(inspect.unwrap(funnel)).parameters)
    if names[: len(FUNNEL_PARAMS)] != FUNNEL_PARAMS:
        problems.append(f"{where}.{FUNNEL}{tuple(names)} expected {FUNNEL_PARAMS}")
    sources = {
        attr: inspect.getsource(value)
        for attr, value in vars(client).items()
        if inspect.isfunction(value)
    }
    for call, allowed in ENGINE_ENTRY_CALLERS.items():
        callers = {attr for attr, source in sources.items() if call in source}
        if not callers & allowed:
            problems.append(f"no longer true: {where} sends requests by {call}...)")
        for caller in sorted(callers - allowed):
            problems.append(
                f"{where}.{caller} calls {call}...) outside {where}.{FUNNEL}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_output_rate.seams [DIR]``: check the installed vLLM,
    or the vLLM source tree in DIR (e.g. an unpacked wheel of a release
    that cannot run here)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.seams")
    parser.add_argument(
        "vllm_source",
        nargs="?",
        help="folder holding the vllm package (default: installed)",
    )
    args = parser.parse_args(argv)
    source = StaticSource(args.vllm_source) if args.vllm_source else LiveSource()
    problems = seam_problems(source)
    for problem in problems:
        print(f"MOVED: {problem}")
    checked = (
        len(EXPECTED_SIGNATURES)
        + len(SOURCE_FACTS)
        + len(HOST_ATTRIBUTES)
        + len(REQUEST_CLASSES)
        + len(BEAM_SEARCH_CLASSES)
    )
    print(
        f"{source.name}: {len(problems)} problem(s) in {checked} seams and "
        f"{len(vllm_imports(PACKAGE_DIR))} imports"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
