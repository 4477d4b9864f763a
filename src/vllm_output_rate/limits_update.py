"""A change to live limits, as the admin API sends it: validated (no vLLM import)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_output_rate.config import (
    DEFAULT_KEY,
    USERS_KEY,
)
from vllm_output_rate.fair_settings import (
    FLOORS_KEY,
    WEIGHTS_KEY,
    parse_user_weights,
)
from vllm_output_rate.prompt_limits import (
    DEFAULT_PROMPT_FLAG,
    DEFAULT_PROMPT_KEY,
    PROMPT_USERS_KEY,
    prompt_rates_in,
)
from vllm_output_rate.teams import REMOVE_TEAMS_KEY, TEAMS_KEY, Teams, parse_teams
from vllm_output_rate.validation import (
    OutputRateConfigError,
    check_object,
    parse_user_rates,
    validate_rate,
    validate_user_name,
)

REMOVE_KEY = "remove_users"
PROMPT_OFF = (
    "prompt-token rates cannot be changed: prompt limiting is off on this "
    f"server (it is turned on at start-up, with {DEFAULT_PROMPT_FLAG})"
)


@dataclass(frozen=True)
class LimitsUpdate:
    """A validated change to live limits (see ``parse_limits_update``)."""

    default_rate: float | None = None
    user_rates: Mapping[str, float] = field(default_factory=dict)
    remove_users: tuple[str, ...] = ()
    user_weights: Mapping[str, float] = field(default_factory=dict)
    user_floors: Mapping[str, float] = field(default_factory=dict)
    prompt_default: float | None = None
    prompt_users: Mapping[str, float] = field(default_factory=dict)
    teams: Teams | None = None  # each replaced whole
    remove_teams: tuple[str, ...] = ()

    @property
    def changes_teams(self) -> bool:
        return self.teams is not None or bool(self.remove_teams)

    @property
    def changes_prompt_rates(self) -> bool:
        return self.prompt_default is not None or bool(self.prompt_users)


def parse_limits_update(payload: object) -> LimitsUpdate:
    """Validate an admin request body, or raise naming the bad field.

    Body: ``{"default_user_output_tokens_per_second": 80,
    "user_output_tokens_per_second": {"user-a": 10}, "remove_users": ["b"],
    "user_output_weight": {"user-a": 2},
    "user_min_output_tokens_per_second": {"user-a": 5},
    "default_user_prompt_tokens_per_second": 3000,
    "user_prompt_tokens_per_second": {"user-a": 500},
    "teams": {"t": {"output_tokens_per_second": 100, "members": ["user-a"]}},
    "remove_teams": ["old-team"]}``, every key optional (``remove_users``
    drops a user's limit, weight, floor and prompt rate; a team given is
    replaced whole, its limit and members).
    """
    payload = check_object(
        payload,
        (
            DEFAULT_KEY,
            USERS_KEY,
            REMOVE_KEY,
            WEIGHTS_KEY,
            FLOORS_KEY,
            DEFAULT_PROMPT_KEY,
            PROMPT_USERS_KEY,
            TEAMS_KEY,
            REMOVE_TEAMS_KEY,
        ),
        "request body",
    )
    remove_teams = payload.get(REMOVE_TEAMS_KEY, [])
    if not isinstance(remove_teams, list):
        raise OutputRateConfigError(
            f"{REMOVE_TEAMS_KEY}: expected a list, got {remove_teams!r}"
        )
    prompt_default, prompt_users = prompt_rates_in(payload, "request body")
    default = payload.get(DEFAULT_KEY)
    remove = payload.get(REMOVE_KEY, [])
    if not isinstance(remove, list):
        raise OutputRateConfigError(f"{REMOVE_KEY}: expected a list, got {remove!r}")
    return LimitsUpdate(
        default_rate=None if default is None else validate_rate(default, DEFAULT_KEY),
        user_rates=parse_user_rates(payload.get(USERS_KEY, {}), USERS_KEY),
        remove_users=tuple(validate_user_name(u, REMOVE_KEY) for u in remove),
        user_weights=parse_user_weights(payload.get(WEIGHTS_KEY, {}), WEIGHTS_KEY),
        user_floors=parse_user_rates(payload.get(FLOORS_KEY, {}), FLOORS_KEY),
        prompt_default=prompt_default,
        prompt_users=prompt_users,
        teams=parse_teams(payload.get(TEAMS_KEY), TEAMS_KEY),
        remove_teams=tuple(
            validate_user_name(t, REMOVE_TEAMS_KEY) for t in remove_teams
        ),
    )
