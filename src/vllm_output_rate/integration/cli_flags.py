"""The command-line flags that switch per-user output rate limiting on."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_output_rate.config import (
    ADDITIONAL_CONFIG_KEY,
    API_KEYS_FLAG,
    DEFAULT_FLAG,
    DEFAULT_METRICS_RECENT_USERS,
    FILE_FLAG,
    METRICS_RECENT_FLAG,
    METRICS_USERS_FLAG,
    USERS_FLAG,
    OutputRateSettings,
    merge_settings,
    parse_metrics_users,
    parse_user_rates,
    validate_recent_users,
)
from vllm_output_rate.validation import OutputRateConfigError, validate_rate

GROUP_TITLE = "OutputRateLimit"


def _rate_arg(text: str) -> float:
    try:
        return validate_rate(float(text), DEFAULT_FLAG)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _users_arg(text: str) -> dict[str, float]:
    try:
        return parse_user_rates(text, USERS_FLAG)
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _metrics_users_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_metrics_users(text, METRICS_USERS_FLAG)
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _recent_users_arg(text: str) -> int:
    try:
        return validate_recent_users(text, METRICS_RECENT_FLAG)
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's flags to vLLM's parser (once)."""
    if DEFAULT_FLAG in parser._option_string_actions:
        return  # a parser built twice in one process
    group = parser.add_argument_group(
        GROUP_TITLE,
        "Per-user output-token rate limits inside vLLM's scheduler "
        "(vllm-output-rate plugin). Off unless "
        f"{DEFAULT_FLAG} is given. Users are named per request by "
        "vllm_xargs.output_rate_user; requests without it share the "
        "'__anonymous__' budget.",
    )
    group.add_argument(
        DEFAULT_FLAG,
        type=_rate_arg,
        default=None,
        metavar="TOK_PER_S",
        help="Enable limiting: every user not listed otherwise may receive this "
        "many output tokens per second, shared by all of that user's requests "
        "and paced evenly (GCRA, 100 ms burst).",
    )
    group.add_argument(
        USERS_FLAG,
        type=_users_arg,
        default=None,
        metavar="JSON",
        help='Per-user limits as a JSON object, e.g. \'{"user-a": 100, '
        '"user-b": 500}\'. Overrides the limits file.',
    )
    group.add_argument(
        API_KEYS_FLAG,
        default=None,
        metavar="FILE",
        help="Trusted identity: YAML/JSON file mapping each user to the SHA-256 "
        "digests of its API keys. Generation requests must then carry "
        "'Authorization: Bearer KEY' and the key's user replaces any "
        "output_rate_user. Needs VLLM_PLUGINS=output_rate,output_rate_http; "
        "do not combine with --api-key.",
    )
    group.add_argument(
        FILE_FLAG,
        default=None,
        metavar="FILE",
        help="JSON or YAML file with default_user_output_tokens_per_second and "
        "user_output_tokens_per_second, for large user tables.",
    )
    group.add_argument(
        METRICS_RECENT_FLAG,
        type=_recent_users_arg,
        default=None,
        metavar="N",
        help="Metrics: up to N users with recent traffic get their own 'user' "
        f"label (default {DEFAULT_METRICS_RECENT_USERS}); every other user is "
        "counted under '__other__'. The admin stats endpoint has every user.",
    )
    group.add_argument(
        METRICS_USERS_FLAG,
        type=_metrics_users_arg,
        default=None,
        metavar="JSON",
        help="Metrics: users that always get their own label, e.g. '[\"vip-1\"]'.",
    )


def settings_from_namespace(args: argparse.Namespace) -> OutputRateSettings | None:
    """Merge the flags over settings given in ``--additional-config``.

    Precedence, lowest first: limits file, --additional-config, flags.
    """
    config_file = getattr(args, "output_rate_config", None)
    default_rate = getattr(args, "default_user_output_tokens_per_second", None)
    user_rates = getattr(args, "user_output_tokens_per_second", None)
    metrics_users = getattr(args, "output_rate_metrics_users", None)
    metrics_recent = getattr(args, "output_rate_metrics_recent_users", None)
    given = (config_file, default_rate, user_rates, metrics_users, metrics_recent)
    if all(value is None for value in given):
        return None
    base = OutputRateSettings.from_additional_config(
        getattr(args, "additional_config", None)
    )
    if base is not None:
        config_file = config_file or base.config_file
        default_rate = default_rate if default_rate is not None else base.default_rate
        user_rates = {**base.user_rates, **(user_rates or {})}
    settings = merge_settings(
        config_file=config_file, default_rate=default_rate, user_rates=user_rates
    )
    if settings is None:
        if metrics_users is not None or metrics_recent is not None:
            raise OutputRateConfigError(
                f"{METRICS_USERS_FLAG} and {METRICS_RECENT_FLAG} need {DEFAULT_FLAG}"
            )
        return None
    if base is not None:
        settings = settings.with_metrics_labels(
            base.metrics_users, base.metrics_recent_users
        )
    return settings.with_metrics_labels(metrics_users, metrics_recent)


def check_api_keys_option(args: argparse.Namespace, limiting: bool) -> None:
    """Refuse a keys file that would be silently ignored."""
    import os

    from vllm_output_rate.api_keys import ApiKeys

    keys_file = getattr(args, "output_rate_api_keys", None)
    if not keys_file:
        return
    if not limiting:
        raise OutputRateConfigError(f"{API_KEYS_FLAG} needs {DEFAULT_FLAG}")
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is None or "output_rate_http" not in plugins.split(","):
        raise OutputRateConfigError(
            f"{API_KEYS_FLAG} needs the HTTP plugin: start with "
            "VLLM_PLUGINS=output_rate,output_rate_http"
        )
    if getattr(args, "api_key", None):
        raise OutputRateConfigError(
            f"{API_KEYS_FLAG} replaces --api-key (both read the Authorization "
            "header); give only one"
        )
    ApiKeys.load(keys_file)  # fail at start-up, not on the first request


def store_in_additional_config(
    additional_config: dict[str, Any] | None, settings: OutputRateSettings
) -> dict[str, Any]:
    merged = dict(additional_config or {})
    merged[ADDITIONAL_CONFIG_KEY] = settings.to_additional_config()
    return merged
