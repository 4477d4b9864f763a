"""The ``type`` functions of the plugin's flags: each parses one flag's text
with the settings' own checks, and turns their error into argparse's (which
names the flag and exits with the message)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from vllm_output_rate.config import (
    DEFAULT_FLAG,
    METRICS_RECENT_FLAG,
    METRICS_USERS_FLAG,
    USERS_FLAG,
)
from vllm_output_rate.fair_settings import (
    CAPACITY_FLAG,
    FLOORS_FLAG,
    WEIGHTS_FLAG,
    parse_user_weights,
)
from vllm_output_rate.metrics_settings import parse_metrics_users, validate_recent_users
from vllm_output_rate.store.settings import FALLBACK_FLAG, check_store_url, redact_url
from vllm_output_rate.validation import (
    OutputRateConfigError,
    parse_user_rates,
    validate_rate,
)

T = TypeVar("T")


def config_arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` from a parser that raises OutputRateConfigError
    (argparse then names the flag and exits with the message)."""

    def parse_arg(text: str) -> T:
        try:
            return parse(text)
        except OutputRateConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_arg


def parsed_with(parse: Callable[[str, str], T], flag: str) -> Callable[[str], T]:
    """An argparse ``type`` from one of config's parsers (errors name ``flag``)."""
    return config_arg(lambda text: parse(text, flag))


users_arg = parsed_with(parse_user_rates, USERS_FLAG)
weights_arg = parsed_with(parse_user_weights, WEIGHTS_FLAG)
floors_arg = parsed_with(parse_user_rates, FLOORS_FLAG)


def rate_arg_for(flag: str) -> Callable[[str], float]:
    """An argparse ``type`` for a rate in tokens per second: a finite
    number > 0 (errors name ``flag`` and the text)."""

    def parse(text: str) -> float:
        try:
            value: object = float(text)
        except ValueError:
            value = text  # validate_rate refuses it, naming the text
        return validate_rate(value, flag)

    return config_arg(parse)


rate_arg = rate_arg_for(DEFAULT_FLAG)
capacity_arg = rate_arg_for(CAPACITY_FLAG)


metrics_users_arg = parsed_with(parse_metrics_users, METRICS_USERS_FLAG)
recent_users_arg = parsed_with(validate_recent_users, METRICS_RECENT_FLAG)


class StoreUrl(str):
    """A store URL that shows without its password (vLLM logs its flags)."""

    def __repr__(self) -> str:
        return repr(str(self))

    def __str__(self) -> str:
        return redact_url(str.__str__(self))  # a plain str: no recursion


store_arg = config_arg(lambda text: StoreUrl(check_store_url(text)))


def share_arg(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(
            f"{FALLBACK_FLAG}: expected a number in (0, 1], got {text!r}"
        )
    return share
