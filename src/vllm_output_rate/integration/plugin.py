"""Entry point of the ``vllm.general_plugins`` group (see pyproject.toml).

vLLM calls ``register()`` in every process it starts (API server, engine
core, workers). It refuses an unsupported vLLM before anything else, checks
the internals listed in ``seams.py`` and installs the wrappers listed there.
With the plugin installed but ``--default-user-output-tokens-per-second`` not
given, vLLM runs its own scheduler: the wrappers then only add the flags to
``--help``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from vllm_output_rate import seams
from vllm_output_rate.integration import (
    admission_flags,
    api_validation,
    cli_flags,
    engine_loop,
    engine_rpc,
    identity_flags,
    prompt_flags,
    team_flags,
)
from vllm_output_rate.integration.compat import check_vllm_version
from vllm_output_rate.integration.engine_setup import apply_output_rate
from vllm_output_rate.seams_check import verify_seams

_MARK = "__vllm_output_rate_wrapped__"
_Fn = Callable[..., Any]


def register() -> None:
    check_vllm_version()
    verify_seams(api=False)
    install()


def _wrap(owner: Any, name: str, make: Callable[[_Fn], _Fn]) -> None:
    """Replace ``owner.name`` by ``make(original)`` once, keeping its kind."""
    raw = inspect.getattr_static(owner, name)
    if getattr(raw, _MARK, False):
        return
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if kind else raw
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, kind(wrapper) if kind else wrapper)


wrap = _wrap  # for the HTTP plugin's hooks (admission_setup.py)


def install() -> None:
    """Install the engine-side wrappers (idempotent; runs in every process)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    def add_cli_args(original: _Fn) -> _Fn:
        def wrapper(parser: Any, *args: Any, **kwargs: Any) -> Any:
            parser = original(parser, *args, **kwargs)
            cli_flags.add_flags(parser)
            admission_flags.add_flags(parser)
            identity_flags.add_flags(parser)
            prompt_flags.add_flags(parser)
            team_flags.add_flags(parser)
            return parser

        return wrapper

    def from_cli_args(original: _Fn) -> _Fn:
        def wrapper(cls: Any, args: Any) -> Any:
            settings = team_flags.with_team_flags(
                args,
                prompt_flags.with_prompt_flags(
                    args, cli_flags.settings_from_namespace(args)
                ),
            )
            additional = getattr(args, "additional_config", None) or {}
            limiting = settings is not None or "output_rate" in additional
            cli_flags.check_api_keys_option(args, limiting=limiting)
            identity_flags.check_identity_options(args, limiting=limiting)
            caps = admission_flags.caps_for(args, settings, limiting)
            if settings is not None:
                # On the namespace too: extra API-server processes rebuild
                # their EngineArgs from it before this plugin is loaded.
                args.additional_config = cli_flags.store_in_additional_config(
                    getattr(args, "additional_config", None), settings
                )
                admission_flags.carry(args, caps)
            return original(cls, args)

        return wrapper

    def create_engine_config(original: _Fn) -> _Fn:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            vllm_config = original(self, *args, **kwargs)
            if apply_output_rate(vllm_config) is not None:
                install_api_validation()
            return vllm_config

        return wrapper

    def post_step(original: _Fn) -> _Fn:
        def wrapper(self: Any, model_executed: bool) -> None:
            original(self, model_executed)
            if not model_executed:
                engine_loop.wait_for_budget(self)

        return wrapper

    if not hasattr(EngineCore, seams.RPC_METHOD):
        setattr(EngineCore, seams.RPC_METHOD, engine_rpc.output_rate_rpc)
    _wrap(EngineArgs, "add_cli_args", add_cli_args)
    _wrap(EngineArgs, "from_cli_args", from_cli_args)
    _wrap(EngineArgs, "create_engine_config", create_engine_config)
    _wrap(EngineCore, "post_step", post_step)


def install_api_validation() -> None:
    """Wrap the OpenAI request classes; only when limiting is on."""

    def to_sampling_params(original: _Fn) -> _Fn:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            params = original(self, *args, **kwargs)
            api_validation.check_sampling_params(params, self)
            return params

        return wrapper

    def to_beam_search_params(original: _Fn) -> _Fn:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            api_validation.refuse_beam_search()
            return original(self, *args, **kwargs)

        return wrapper

    for module, name in seams.REQUEST_CLASSES:
        _wrap(seams.resolve(module, name), "to_sampling_params", to_sampling_params)
    for module, name in seams.BEAM_SEARCH_CLASSES:
        _wrap(
            seams.resolve(module, name), "to_beam_search_params", to_beam_search_params
        )
