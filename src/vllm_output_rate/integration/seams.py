"""Every place where this plugin touches vLLM internals, in one module.

vLLM offers ``scheduler_cls``, plugin entry points and ``additional_config``;
everything else the plugin needs is a small wrapper or override listed here.
``verify_seams()`` checks at start-up that each one still exists with the
signature it was written for, and tests/test_seams.py runs the same check,
so a vLLM upgrade that moves one fails loudly instead of silently turning
limiting off.

Wrapped (in the process where vLLM calls them):
* ``EngineArgs.add_cli_args``: adds the plugin's flags to vLLM's parser.
* ``EngineArgs.from_cli_args``: carries the flags into ``additional_config``.
* ``EngineArgs.create_engine_config``: validates and selects our scheduler.
* ``EngineCore.post_step``: waits on the input queue while all is throttled.
* ``EngineCore.output_rate_rpc`` (added): the engine-side method that the
  HTTP plugin reaches through vLLM's utility-call channel
  (``call_utility_async``), to read statistics and change limits.
* ``ChatCompletionRequest/CompletionRequest/ResponsesRequest
  .to_sampling_params`` and ``.to_beam_search_params``: HTTP 400 for a
  malformed ``output_rate_user`` and for beam search.

Overridden private Scheduler methods (see scheduling/scheduler.py):
``_reserve_prefill_lookahead``, ``_handle_blocked_waiting_request``; the
attribute ``max_num_active_reqs`` is read by vLLM's waiting loop. The fast
path (no limit binds) relies on two more facts: ``schedule()`` looks the hook
up on ``self`` at each call (so an instance attribute can stand in for the
override during a step), and ``_update_after_schedule`` sets
``Request.is_prefill_chunk`` on every scheduled request before ``schedule()``
returns (so the step's sampled tokens can be counted afterwards). Each
step's demand is kept from ``Scheduler.finished_req_ids`` (filled by
``_free_request``, read before ``schedule()`` clears it), with a recount
whenever it disagrees with ``Scheduler.requests``; and when vLLM's
``_inflight_prefills`` (requests whose prefill continues after this step) is
empty, every scheduled request sampled.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from vllm_output_rate.integration import (
    api_validation,
    cli_flags,
    engine_loop,
    engine_rpc,
)
from vllm_output_rate.integration.engine_setup import apply_output_rate

_MARK = "__vllm_output_rate_wrapped__"
RPC_METHOD = engine_rpc.RPC_METHOD

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
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ["self", "request"]),
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


class SeamMovedError(RuntimeError):
    pass


def _resolve(module: str, path: str) -> Any:
    import importlib

    owner: Any = importlib.import_module(module)
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def verify_seams(*, api: bool = True) -> None:
    """Raise SeamMovedError naming every internal that is gone or changed.

    ``api=False`` skips the OpenAI request classes (engine processes never
    import the API server).
    """
    problems = []
    for module, path, params in EXPECTED_SIGNATURES:
        try:
            target = _resolve(module, path)
        except (ImportError, AttributeError):
            problems.append(f"{module}.{path} no longer exists")
            continue
        names = list(inspect.signature(inspect.unwrap(target)).parameters)
        if params not in (names[: len(params)], names[1 : len(params) + 1]):
            problems.append(f"{module}.{path}{tuple(names)} expected {params}")
    methods = [(cls, "to_sampling_params") for cls in REQUEST_CLASSES]
    methods += [(cls, "to_beam_search_params") for cls in BEAM_SEARCH_CLASSES]
    for (module, name), method in methods if api else []:
        try:
            _resolve(module, f"{name}.{method}")
        except (ImportError, AttributeError):
            problems.append(f"{module}.{name}.{method} no longer exists")
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule_source = inspect.getsource(Scheduler.schedule)
    after_schedule_source = inspect.getsource(Scheduler._update_after_schedule)
    source_facts = [
        (
            schedule_source,
            "self.max_num_active_reqs",
            "Scheduler.schedule reads max_num_active_reqs",
        ),
        (
            schedule_source,
            "self._reserve_prefill_lookahead(",
            "Scheduler.schedule calls self._reserve_prefill_lookahead",
        ),
        (
            schedule_source,
            "self._update_after_schedule(",
            "Scheduler.schedule calls self._update_after_schedule",
        ),
        (
            after_schedule_source,
            "request.is_prefill_chunk =",
            "Scheduler._update_after_schedule sets Request.is_prefill_chunk",
        ),
        (
            after_schedule_source,
            "self._inflight_prefills.discard(",
            "Scheduler._update_after_schedule drops finished prefills from "
            "_inflight_prefills",
        ),
        (
            inspect.getsource(Scheduler.__init__),
            "self._inflight_prefills",
            "Scheduler keeps _inflight_prefills",
        ),
        (
            inspect.getsource(Scheduler._free_request),
            "self.finished_req_ids.add(",
            "Scheduler._free_request records finished_req_ids",
        ),
    ]
    for source, needle, fact in source_facts:
        if needle not in source:
            problems.append(f"no longer true: {fact}")
    if problems:
        raise SeamMovedError(
            "vllm-output-rate cannot hook into this vLLM: " + "; ".join(problems)
        )


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)`` once, keeping its kind."""
    raw = inspect.getattr_static(owner, name)
    if getattr(raw, _MARK, False):
        return
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if kind else raw
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, kind(wrapper) if kind else wrapper)


def install() -> None:
    """Install the engine-side wrappers (idempotent; runs in every process)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    def add_cli_args(original: Callable) -> Callable:
        def wrapper(parser: Any, *args: Any, **kwargs: Any) -> Any:
            parser = original(parser, *args, **kwargs)
            cli_flags.add_flags(parser)
            return parser

        return wrapper

    def from_cli_args(original: Callable) -> Callable:
        def wrapper(cls: Any, args: Any) -> Any:
            settings = cli_flags.settings_from_namespace(args)
            additional = getattr(args, "additional_config", None) or {}
            cli_flags.check_api_keys_option(
                args, limiting=settings is not None or "output_rate" in additional
            )
            if settings is not None:
                # On the namespace too: extra API-server processes rebuild
                # their EngineArgs from it before this plugin is loaded.
                args.additional_config = cli_flags.store_in_additional_config(
                    getattr(args, "additional_config", None), settings
                )
            return original(cls, args)

        return wrapper

    def create_engine_config(original: Callable) -> Callable:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            vllm_config = original(self, *args, **kwargs)
            if apply_output_rate(vllm_config) is not None:
                install_api_validation()
            return vllm_config

        return wrapper

    def post_step(original: Callable) -> Callable:
        def wrapper(self: Any, model_executed: bool) -> None:
            original(self, model_executed)
            if not model_executed:
                engine_loop.wait_for_budget(self)

        return wrapper

    if not hasattr(EngineCore, RPC_METHOD):
        setattr(EngineCore, RPC_METHOD, engine_rpc.output_rate_rpc)
    _wrap(EngineArgs, "add_cli_args", add_cli_args)
    _wrap(EngineArgs, "from_cli_args", from_cli_args)
    _wrap(EngineArgs, "create_engine_config", create_engine_config)
    _wrap(EngineCore, "post_step", post_step)


def install_api_validation() -> None:
    """Wrap the OpenAI request classes; only when limiting is on."""

    def to_sampling_params(original: Callable) -> Callable:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            params = original(self, *args, **kwargs)
            api_validation.check_sampling_params(params)
            return params

        return wrapper

    def to_beam_search_params(original: Callable) -> Callable:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            api_validation.refuse_beam_search()
            return original(self, *args, **kwargs)

        return wrapper

    for module, name in REQUEST_CLASSES:
        _wrap(_resolve(module, name), "to_sampling_params", to_sampling_params)
    for module, name in BEAM_SEARCH_CLASSES:
        _wrap(_resolve(module, name), "to_beam_search_params", to_beam_search_params)
