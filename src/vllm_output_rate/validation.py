"""The checks every input goes through: a user name, a rate, an object's keys
(no vLLM import).

One set of rules for every way in (flags, limits file, admin endpoint, API
keys file, request bodies and headers, the limiter's own API), so a name
accepted in one place is never refused in another. Errors are
``OutputRateConfigError`` (a ``ValueError``) whose message names where the
value came from.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

MAX_USER_NAME_LENGTH = 256
# C0 controls, DEL and C1 controls: never part of a name, and a name is
# printed to terminals (``top``), logs and metrics labels.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


class OutputRateConfigError(ValueError):
    """A setting or input is malformed; the message names the option and the value."""


def validate_user_name(user: object, where: str = "user") -> str:
    """Return ``user`` if it is a non-empty string of at most 256 characters
    without control characters."""
    if not isinstance(user, str):
        raise OutputRateConfigError(
            f"{where}: user name must be a string, got {user!r}"
        )
    if not user:
        raise OutputRateConfigError(
            f"{where}: user name must not be empty, got {user!r}"
        )
    if len(user) > MAX_USER_NAME_LENGTH:
        raise OutputRateConfigError(
            f"{where}: user name {user[:40]!r}... is {len(user)} characters long; "
            f"the limit is {MAX_USER_NAME_LENGTH}"
        )
    if _CONTROL.search(user):
        raise OutputRateConfigError(
            f"{where}: user name {user[:40]!r} contains a control character"
        )
    return user


def validate_number(value: object, where: str) -> float:
    """Return ``value`` as a float if it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OutputRateConfigError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise OutputRateConfigError(
            f"{where} must be a finite number > 0, got {value!r}"
        )
    return float(value)


def validate_rate(rate: object, where: str = "rate") -> float:
    """Return ``rate`` as a float if it is a finite number of tokens per second > 0."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise OutputRateConfigError(
            f"{where} must be a number of tokens per second, got {rate!r}"
        )
    if not math.isfinite(rate) or rate <= 0:
        raise OutputRateConfigError(
            f"{where} must be a finite number > 0, got {rate!r}"
        )
    return float(rate)


def check_object(
    value: object, allowed: tuple[str, ...], where: str
) -> Mapping[str, Any]:
    """``value`` as an object whose keys are all in ``allowed``."""
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(f"{where}: expected an object, got {value!r}")
    unknown = set(value) - set(allowed)
    if unknown:
        raise OutputRateConfigError(
            f"{where}: unknown keys {sorted(unknown)}; expected {list(allowed)}"
        )
    return value


def validate_switch(value: object, where: str) -> bool:
    """A setting that is on or off: JSON true or false, nothing else."""
    if not isinstance(value, bool):
        raise OutputRateConfigError(f"{where} must be true or false, got {value!r}")
    return value


def parsed_json(value: object, where: str) -> object:
    """``value`` itself, or parsed when it is JSON text (as flags give it)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise OutputRateConfigError(
            f"{where}: not valid JSON ({exc.msg} at character {exc.pos}): {value!r}"
        ) from None


def parse_user_rates(value: object, where: str) -> dict[str, float]:
    """A JSON object (or its text) of user name to tok/s, validated."""
    value = parsed_json(value, where)
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{where}: expected a JSON object of user name to tokens per second, "
            f"got {value!r}"
        )
    return {
        validate_user_name(user, where): validate_rate(
            rate, f"{where}: rate of user {user!r}"
        )
        for user, rate in value.items()
    }
