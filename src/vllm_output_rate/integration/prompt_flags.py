"""The flags of per-user prompt-token rates (``prompt_limits.py``).

Two flags join the plugin's group and win over the same keys in
``--additional-config``; like every limit they need output limiting on
(``--default-user-output-tokens-per-second``, the plugin's switch).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from vllm_output_rate.config import DEFAULT_FLAG, OutputRateSettings, file_prompt_rates
from vllm_output_rate.integration.cli_flags import plugin_group
from vllm_output_rate.integration.flag_types import parsed_with, rate_arg_for
from vllm_output_rate.prompt_limits import (
    DEFAULT_PROMPT_FLAG,
    PROMPT_USERS_FLAG,
    combine,
    rates_of,
)
from vllm_output_rate.validation import (
    OutputRateConfigError,
    parse_user_rates,
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the prompt-rate flags to the plugin's group (once)."""
    if DEFAULT_PROMPT_FLAG in parser._option_string_actions:
        return
    group = plugin_group(parser)
    group.add_argument(
        DEFAULT_PROMPT_FLAG,
        type=rate_arg_for(DEFAULT_PROMPT_FLAG),
        default=None,
        metavar="TOK_PER_S",
        help="Prompt tokens each user may have computed per second (prefill and "
        "recomputation; prefix-cache hits are free), paced like output tokens: "
        "a user over it waits, never fails. Default: not limited.",
    )
    group.add_argument(
        PROMPT_USERS_FLAG,
        type=parsed_with(parse_user_rates, PROMPT_USERS_FLAG),
        default=None,
        metavar="JSON",
        help="Per-user prompt-token rates, e.g. '{\"batch\": 2000}'.",
    )


def with_prompt_flags(
    args: argparse.Namespace, settings: OutputRateSettings | None
) -> OutputRateSettings | None:
    """``settings`` with their prompt limits: a limits file's, under those of
    ``--additional-config``, under the prompt-rate flags; the flags are
    refused without output limiting."""
    default = getattr(args, "default_user_prompt_tokens_per_second", None)
    users = getattr(args, "user_prompt_tokens_per_second", None)
    if settings is None and default is None and users is None:
        return None
    if settings is None:
        # Output limits given in --additional-config only.
        settings = OutputRateSettings.from_additional_config(
            getattr(args, "additional_config", None)
        )
    if settings is None:
        raise OutputRateConfigError(
            f"{DEFAULT_PROMPT_FLAG} and {PROMPT_USERS_FLAG} need {DEFAULT_FLAG}"
        )
    limits = combine(
        file_prompt_rates(settings.config_file),
        rates_of(settings.prompt_limits),
        (default, users or {}),
        no_default=f"{PROMPT_USERS_FLAG} (or the limits file's) was given without "
        f"{DEFAULT_PROMPT_FLAG}: per-user prompt rates need a default for "
        "everyone else",
    )
    return replace(settings, prompt_limits=limits)
