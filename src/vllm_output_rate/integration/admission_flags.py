"""The flags of per-user admission caps, and where they go.

Four flags join the plugin's group; with the limits file and
``--additional-config`` they merge (lowest first: file, additional config,
flags) into the admission keys of ``additional_config['output_rate']``,
where the engine reads them (``admission_rpc.CapsHolder``). Caps need
limiting on and the HTTP part (``VLLM_PLUGINS=...,output_rate_http``),
which enforces them; so do vLLM's own ``--max-num-queued-reqs`` and
``--max-num-queued-tokens`` with limiting on, since without it a throttled
user's paused requests would fill them for everyone.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from vllm_output_rate.admission_caps import (
    DEFAULT_REQUESTS_FLAG,
    DEFAULT_REQUESTS_KEY,
    DEFAULT_TOKENS_FLAG,
    DEFAULT_TOKENS_KEY,
    GLOBAL_REQUESTS_FLAG,
    GLOBAL_TOKENS_FLAG,
    REQUESTS_FLAG,
    REQUESTS_KEY,
    TOKENS_FLAG,
    TOKENS_KEY,
    GlobalCaps,
    admission_part,
    caps_from_document,
    parse_user_caps,
    validate_cap,
)
from vllm_output_rate.config import ADDITIONAL_CONFIG_KEY, DEFAULT_FLAG, FILE_FLAG
from vllm_output_rate.integration.cli_flags import plugin_group
from vllm_output_rate.integration.flag_types import config_arg
from vllm_output_rate.validation import OutputRateConfigError

HTTP_PLUGIN = "output_rate_http"


def _whole(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value: object = int(text)
        except ValueError:
            value = text
        return validate_cap(value, flag)

    return parse


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the caps' flags to the plugin's group (once)."""
    if DEFAULT_REQUESTS_FLAG in parser._option_string_actions:
        return
    group = plugin_group(parser)
    group.add_argument(
        DEFAULT_REQUESTS_FLAG,
        type=config_arg(_whole(DEFAULT_REQUESTS_FLAG)),
        default=None,
        metavar="N",
        help="Admission: each user may have at most N requests in flight "
        "(n > 1 counts n); more get HTTP 429 with Retry-After. Default: "
        f"{GLOBAL_REQUESTS_FLAG} when given, else no cap. Needs "
        "VLLM_PLUGINS=output_rate,output_rate_http.",
    )
    group.add_argument(
        REQUESTS_FLAG,
        type=config_arg(lambda text: parse_user_caps(text, REQUESTS_FLAG)),
        default=None,
        metavar="JSON",
        help="Admission: per-user caps on requests in flight, e.g. '{\"batch\": 4}'.",
    )
    group.add_argument(
        DEFAULT_TOKENS_FLAG,
        type=config_arg(_whole(DEFAULT_TOKENS_FLAG)),
        default=None,
        metavar="N",
        help="Admission: once a user's requests waiting for their first token "
        "hold N prompt tokens, its next request gets HTTP 429. Default: "
        f"{GLOBAL_TOKENS_FLAG} when given, else no cap.",
    )
    group.add_argument(
        TOKENS_FLAG,
        type=config_arg(lambda text: parse_user_caps(text, TOKENS_FLAG)),
        default=None,
        metavar="JSON",
        help="Admission: per-user caps on queued prompt tokens, e.g. "
        "'{\"batch\": 8000}'.",
    )


def _file_caps(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        content = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}  # reported, naming the file, by the limits' own reading
    return admission_part(content) if isinstance(content, dict) else {}


def caps_document(args: argparse.Namespace, config_file: str | None) -> dict[str, Any]:
    """The admission keys from the limits file, ``--additional-config`` and
    the flags (in that order, later wins), validated against vLLM's caps."""
    global_caps = GlobalCaps(
        getattr(args, "max_num_queued_reqs", None),
        getattr(args, "max_num_queued_tokens", None),
    )
    section = (getattr(args, "additional_config", None) or {}).get(
        ADDITIONAL_CONFIG_KEY
    )
    flags = {
        DEFAULT_REQUESTS_KEY: getattr(
            args, "default_user_max_concurrent_requests", None
        ),
        REQUESTS_KEY: getattr(args, "user_max_concurrent_requests", None),
        DEFAULT_TOKENS_KEY: getattr(
            args, "default_user_max_queued_prompt_tokens", None
        ),
        TOKENS_KEY: getattr(args, "user_max_queued_prompt_tokens", None),
    }
    caps = caps_from_document(
        _file_caps(config_file), global_caps, f"{FILE_FLAG} {config_file}"
    )
    if isinstance(section, dict):
        caps = caps.updated(
            admission_part(section),
            global_caps,
            f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]",
        )
    caps = caps.updated(
        {key: value for key, value in flags.items() if value is not None}, global_caps
    )
    return caps.to_document()


def any_caps_flag(args: argparse.Namespace) -> bool:
    return any(
        getattr(args, name, None) is not None
        for name in (
            "default_user_max_concurrent_requests",
            "user_max_concurrent_requests",
            "default_user_max_queued_prompt_tokens",
            "user_max_queued_prompt_tokens",
        )
    )


def check_admission_options(
    args: argparse.Namespace, limiting: bool, document: dict[str, Any] | None
) -> None:
    """Refuse caps that nothing would enforce, and vLLM's own caps that a
    throttled user's paused requests could fill for everyone."""
    if not limiting:
        if any_caps_flag(args):
            raise OutputRateConfigError(
                f"{DEFAULT_REQUESTS_FLAG} and the other admission caps need "
                f"{DEFAULT_FLAG}"
            )
        return
    given = [
        flag
        for flag, name in (
            (GLOBAL_REQUESTS_FLAG, "max_num_queued_reqs"),
            (GLOBAL_TOKENS_FLAG, "max_num_queued_tokens"),
        )
        if getattr(args, name, None) is not None
    ]
    if document and not caps_from_document(document, GlobalCaps()).is_empty():
        given.append("admission caps")
    plugins = os.environ.get("VLLM_PLUGINS")
    if not given or (plugins is not None and HTTP_PLUGIN in plugins.split(",")):
        return
    raise OutputRateConfigError(
        f"{' and '.join(given)} with per-user limits need the HTTP plugin, "
        "which keeps a throttled user's paused requests from filling the "
        "server's queue for everyone: start with "
        "VLLM_PLUGINS=output_rate,output_rate_http"
    )


def caps_for(
    args: argparse.Namespace, settings: Any, limiting: bool
) -> dict[str, Any] | None:
    """The merged caps (None without limiting), after refusing options that
    cannot be kept (``check_admission_options``)."""
    document = None
    if limiting:
        section = (getattr(args, "additional_config", None) or {}).get(
            ADDITIONAL_CONFIG_KEY
        ) or {}
        config_file = (
            settings.config_file if settings is not None else section.get("config_file")
        )
        document = caps_document(args, config_file)
    check_admission_options(args, limiting, document)
    return document


def carry(args: argparse.Namespace, document: dict[str, Any] | None) -> None:
    """Put the merged caps into ``additional_config['output_rate']``."""
    if document:
        args.additional_config[ADDITIONAL_CONFIG_KEY].update(document)
