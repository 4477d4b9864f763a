"""The command-line flags that switch per-user output rate limiting on."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, TypeVar

from vllm_output_rate.config import (
    ADDITIONAL_CONFIG_KEY,
    API_KEYS_FLAG,
    DEFAULT_FLAG,
    DEFAULT_KEY,
    FILE_FLAG,
    METRICS_RECENT_FLAG,
    METRICS_USERS_FLAG,
    USERS_FLAG,
    OutputRateSettings,
    load_store_settings,
    merge_settings,
)
from vllm_output_rate.fair_settings import (
    CAPACITY_FLAG,
    FLOORS_FLAG,
    WEIGHTS_FLAG,
)
from vllm_output_rate.integration.flag_types import (
    capacity_arg,
    floors_arg,
    metrics_users_arg,
    rate_arg,
    recent_users_arg,
    share_arg,
    store_arg,
    users_arg,
    weights_arg,
)
from vllm_output_rate.metrics_settings import DEFAULT_METRICS_RECENT_USERS
from vllm_output_rate.store.settings import (
    FALLBACK_FLAG,
    FALLBACK_KEY,
    STORE_FLAG,
    STORE_REQUIRED_FLAG,
    STORE_REQUIRED_KEY,
    STORE_URL_KEY,
    StoreSettings,
)
from vllm_output_rate.validation import (
    OutputRateConfigError,
)

GROUP_TITLE = "OutputRateLimit"
T = TypeVar("T")


def plugin_group(parser: argparse.ArgumentParser) -> Any:
    """The plugin's argument group (``add_cli_args`` made it), else the
    parser itself: where the other flag modules add theirs."""
    return next((g for g in parser._action_groups if g.title == GROUP_TITLE), parser)


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
        type=rate_arg,
        default=None,
        metavar="TOK_PER_S",
        help="Enable limiting: every user not listed otherwise may receive this "
        "many output tokens per second, shared by all of that user's requests "
        "and paced evenly (GCRA, 100 ms burst).",
    )
    group.add_argument(
        USERS_FLAG,
        type=users_arg,
        default=None,
        metavar="JSON",
        help='Per-user limits as a JSON object, e.g. \'{"user-a": 100, '
        '"user-b": 500}\'. Overrides the limits file.',
    )
    group.add_argument(
        WEIGHTS_FLAG,
        type=weights_arg,
        default=None,
        metavar="JSON",
        help="Fair shares when the engine is full: per-user weights, e.g. "
        "'{\"tenant-a\": 2}' (default 1). Users below their limits share "
        "scarce batch places in proportion to weight, counted in tokens "
        "(output tokens, prompt tokens at half).",
    )
    group.add_argument(
        FLOORS_FLAG,
        type=floors_arg,
        default=None,
        metavar="JSON",
        help="Guaranteed floors, e.g. '{\"tenant-a\": 300}' (tok/s): a user "
        "below its floor goes before everyone above theirs when the engine is "
        f"full. Best effort unless {CAPACITY_FLAG} is given.",
    )
    group.add_argument(
        CAPACITY_FLAG,
        type=capacity_arg,
        default=None,
        metavar="TOK_PER_S",
        help="Output tokens per second this engine sustains under load; "
        "floors summing to more are refused at start-up and in updates.",
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
        type=recent_users_arg,
        default=None,
        metavar="N",
        help="Metrics: up to N users with recent traffic get their own 'user' "
        f"label (default {DEFAULT_METRICS_RECENT_USERS}); every other user is "
        "counted under '__other__'. The admin stats endpoint has every user.",
    )
    group.add_argument(
        METRICS_USERS_FLAG,
        type=metrics_users_arg,
        default=None,
        metavar="JSON",
        help="Metrics: users that always get their own label, e.g. '[\"vip-1\"]'.",
    )
    group.add_argument(
        STORE_FLAG,
        type=store_arg,
        default=None,
        metavar="URL",
        help="Share every user's budget with all engines using this Redis/Valkey "
        "store (redis://, rediss://, valkey://, valkeys://, unix://); needed for "
        "--data-parallel-size > 1. A password in the URL is never logged; or give "
        "it in VLLM_OUTPUT_RATE_STORE_PASSWORD.",
    )
    group.add_argument(
        STORE_REQUIRED_FLAG,
        action="store_true",
        default=None,
        help="Refuse to start when the store is unreachable (default: start, "
        "each engine serving its fallback share until the store is reachable).",
    )
    group.add_argument(
        FALLBACK_FLAG,
        type=share_arg,
        default=None,
        metavar="SHARE",
        help="Part of every limit an engine serves on its own while the store is "
        "unreachable (default: 1 / the number of engines it last saw).",
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
    store_url = getattr(args, "output_rate_store", None)
    store_required = getattr(args, "output_rate_store_required", None)
    fallback_share = getattr(args, "output_rate_store_fallback_share", None)
    weights = getattr(args, "user_output_weight", None)
    floors = getattr(args, "user_min_output_tokens_per_second", None)
    capacity = getattr(args, "output_rate_engine_capacity", None)
    store_flags = (store_url, store_required, fallback_share)
    given = (
        config_file,
        default_rate,
        user_rates,
        metrics_users,
        metrics_recent,
        weights,
        floors,
        capacity,
    )
    if all(value is None for value in given):
        if any(flag is not None for flag in store_flags):
            raise OutputRateConfigError(
                f"{STORE_FLAG} and its options need {DEFAULT_FLAG}"
            )
        return None
    base = OutputRateSettings.from_additional_config(
        _section_with_flags(
            getattr(args, "additional_config", None), default_rate, store_url
        )
    )
    store = None
    if base is not None:
        config_file = config_file or base.config_file
        default_rate = default_rate if default_rate is not None else base.default_rate
        user_rates = {**base.user_rates, **(user_rates or {})}
        weights = {**base.user_weights, **(weights or {})}
        floors = {**base.user_floors, **(floors or {})}
        capacity = capacity if capacity is not None else base.engine_capacity
        store = base.store
    if store is None and config_file:
        store = load_store_settings(config_file)
    if store_url is not None or (
        store is not None and any(flag is not None for flag in store_flags)
    ):
        fields = {} if store is None else store.to_config()
        fields.update(
            {
                key: value
                for key, value in (
                    (
                        STORE_URL_KEY,
                        None if store_url is None else str.__str__(store_url),
                    ),
                    (STORE_REQUIRED_KEY, store_required),
                    (FALLBACK_KEY, fallback_share),
                )
                if value is not None
            }
        )
        store = StoreSettings.from_config(fields, STORE_FLAG)
    elif any(flag is not None for flag in store_flags):
        raise OutputRateConfigError(
            f"{STORE_REQUIRED_FLAG} and {FALLBACK_FLAG} need {STORE_FLAG}"
        )
    settings = merge_settings(
        config_file=config_file,
        default_rate=default_rate,
        user_rates=user_rates,
        store=store,
        weights=weights,
        floors=floors,
        capacity=capacity,
    )
    if settings is None:
        if metrics_users is not None or metrics_recent is not None:
            raise OutputRateConfigError(
                f"{METRICS_USERS_FLAG} and {METRICS_RECENT_FLAG} need {DEFAULT_FLAG}"
            )
        return None
    if base is not None:
        # The switches only additional_config sets.
        settings = replace(
            settings.with_metrics_labels(base.metrics_users, base.metrics_recent_users),
            shortcuts=base.shortcuts,
            fair_step_tokens=base.fair_step_tokens,
            prompt_limits=base.prompt_limits,
        )
    return settings.with_metrics_labels(metrics_users, metrics_recent)


def _section_with_flags(
    additional_config: dict[str, Any] | None,
    default_rate: object,
    store_url: str | None,
) -> dict[str, Any] | None:
    """``additional_config`` with the default and store URL flags in its
    section, so that a section holding only part of the settings (store
    tuning such as ``store_timeout_s``, per-user limits) combines with the
    flags instead of being refused for lacking them. Flags win here as they
    do everywhere."""
    section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if not isinstance(section, dict):
        return additional_config
    section = dict(section)
    if default_rate is not None:
        section[DEFAULT_KEY] = default_rate
    if store_url is not None:
        section[STORE_URL_KEY] = str.__str__(store_url)
    return {**(additional_config or {}), ADDITIONAL_CONFIG_KEY: section}


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
