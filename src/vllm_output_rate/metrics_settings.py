"""Which users get a metrics label of their own: the settings (no vLLM import).

Every user is counted; labels are bounded: the listed users, and up to
``metrics_recent_users`` users with recent traffic, get one each, every
other user shares ``__other__`` (``scheduling/stats.py``).
"""

from __future__ import annotations

from vllm_output_rate.validation import (
    OutputRateConfigError,
    parsed_json,
    validate_user_name,
)

# How many users with recent traffic get their own metrics label by default
# (besides the listed ones, __anonymous__ and __other__).
DEFAULT_METRICS_RECENT_USERS = 100
MAX_METRICS_RECENT_USERS = 10_000


def parse_metrics_users(value: object, where: str) -> tuple[str, ...]:
    """A JSON list (or its text) of user names that always get a label."""
    value = parsed_json(value, where)
    if not isinstance(value, (list, tuple)):
        raise OutputRateConfigError(
            f"{where}: expected a JSON list of user names, got {value!r}"
        )
    return tuple(dict.fromkeys(validate_user_name(user, where) for user in value))


def validate_recent_users(value: object, where: str) -> int:
    """How many recently active users get their own label (0 to 10,000)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 0 <= value <= MAX_METRICS_RECENT_USERS
    ):
        raise OutputRateConfigError(
            f"{where} must be a whole number from 0 to {MAX_METRICS_RECENT_USERS:,}, "
            f"got {value!r}"
        )
    return value
