"""Fair shares as settings: users' weights and floors, the engine's declared
capacity, their names and their checks (no vLLM import).

Read with the other settings (``config.py``), the admin API's changes
(``limits_update.py``) and a reloaded limits file; how the step uses them:
``scheduling/fair_share.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from vllm_output_rate.validation import (
    OutputRateConfigError,
    parsed_json,
    validate_number,
    validate_user_name,
)

WEIGHTS_FLAG = "--user-output-weight"
FLOORS_FLAG = "--user-min-output-tokens-per-second"
CAPACITY_FLAG = "--output-rate-engine-capacity"
WEIGHTS_KEY = "user_output_weight"
FLOORS_KEY = "user_min_output_tokens_per_second"
CAPACITY_KEY = "engine_capacity_tokens_per_second"
FAIR_KEYS = (WEIGHTS_KEY, FLOORS_KEY, CAPACITY_KEY)
# The largest weight: a million times the default keeps virtual service
# counters well inside a float's precision.
MAX_WEIGHT = 1e6


def parse_user_weights(value: object, where: str) -> dict[str, float]:
    """A JSON object (or its text) of user name to weight, in (0, 1e6]."""
    value = parsed_json(value, where)
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{where}: expected a JSON object of user name to weight, got {value!r}"
        )
    weights = {}
    for user, weight in value.items():
        name = validate_user_name(user, where)
        checked = validate_number(weight, f"{where}: weight of user {user!r}")
        if checked > MAX_WEIGHT:
            raise OutputRateConfigError(
                f"{where}: weight of user {user!r} must be at most {MAX_WEIGHT:g}, "
                f"got {weight!r}"
            )
        weights[name] = checked
    return weights


def check_floors(
    floors: Mapping[str, float],
    ceiling_of: Callable[[str], float],
    capacity: float | None,
    where: str = FLOORS_FLAG,
) -> None:
    """Refuse floors that cannot be kept: above the user's own ceiling, or
    summing to more than the declared engine capacity."""
    for user, floor in floors.items():
        ceiling = ceiling_of(user)
        if floor > ceiling:
            raise OutputRateConfigError(
                f"{where}: floor of user {user!r} ({floor:g} tok/s) is above its "
                f"limit ({ceiling:g} tok/s)"
            )
    total = sum(floors.values())
    if capacity is not None and total > capacity:
        raise OutputRateConfigError(
            f"{where}: floors sum to {total:g} tok/s, more than the engine "
            f"capacity {CAPACITY_FLAG} {capacity:g} tok/s; lower some floors "
            "or declare a larger capacity"
        )
