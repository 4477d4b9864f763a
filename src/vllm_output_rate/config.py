"""The operator's settings: parsing and validation, with no vLLM import.

Settings can come from three places, merged in this order (later wins):
a JSON or YAML limits file, ``--additional-config '{"output_rate": {...}}'``,
and the two command-line flags. Every error names the option and the value.

The admin API's update body: ``limits_update.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from vllm_output_rate.admission_caps import ADMISSION_KEYS
from vllm_output_rate.fair_settings import (
    CAPACITY_FLAG,
    CAPACITY_KEY,
    FAIR_KEYS,
    FLOORS_FLAG,
    FLOORS_KEY,
    WEIGHTS_FLAG,
    WEIGHTS_KEY,
    check_floors,
    parse_user_weights,
)
from vllm_output_rate.metrics_settings import (
    DEFAULT_METRICS_RECENT_USERS,
    parse_metrics_users,
    validate_recent_users,
)
from vllm_output_rate.prompt_limits import (
    NO_RATES,
    PROMPT_KEYS,
    PromptLimits,
    Rates,
    prompt_limits_from,
    prompt_rates_in,
)
from vllm_output_rate.store.settings import STORE_KEYS, StoreSettings
from vllm_output_rate.teams import (
    TEAMS_KEY,
    Teams,
    check_team_floors,
    layered_teams,
    parse_teams,
)
from vllm_output_rate.validation import (
    OutputRateConfigError,
    check_object,
    parse_user_rates,
    validate_rate,
    validate_switch,
)

# The key under vLLM's `additional_config` that carries our settings.
ADDITIONAL_CONFIG_KEY = "output_rate"
DEFAULT_FLAG = "--default-user-output-tokens-per-second"
USERS_FLAG = "--user-output-tokens-per-second"
FILE_FLAG = "--output-rate-config"
API_KEYS_FLAG = "--output-rate-api-keys"
METRICS_USERS_FLAG = "--output-rate-metrics-users"
METRICS_RECENT_FLAG = "--output-rate-metrics-recent-users"
DEFAULT_KEY = "default_user_output_tokens_per_second"
USERS_KEY = "user_output_tokens_per_second"
FILE_KEY = "config_file"
METRICS_USERS_KEY = "metrics_users"
METRICS_RECENT_KEY = "metrics_recent_users"
# false: run every step on the reference path, without the speed-only
# shortcuts (scheduling/shortcuts.py); the same decisions, more CPU.
SHORTCUTS_KEY = "shortcuts"
# false: vLLM sizes every prefill chunk (scheduling/token_shares.py).
FAIR_STEP_TOKENS_KEY = "fair_step_tokens"
# Requests that do not name a user share this budget.
ANONYMOUS_USER = "__anonymous__"


@dataclass(frozen=True)
class OutputRateSettings:
    """Validated settings: limits in tok/s, metrics labels, store, fairness."""

    default_rate: float
    user_rates: Mapping[str, float] = field(default_factory=dict)
    config_file: str | None = None
    metrics_users: tuple[str, ...] = ()
    metrics_recent_users: int = DEFAULT_METRICS_RECENT_USERS
    # A shared store: one budget per user across every engine that uses it.
    store: StoreSettings | None = None
    # Fair shares when the engine is full: weights (default 1), floors in
    # tok/s, and the engine's declared capacity that floors must fit in.
    user_weights: Mapping[str, float] = field(default_factory=dict)
    user_floors: Mapping[str, float] = field(default_factory=dict)
    engine_capacity: float | None = None
    # The step's speed-only shortcuts (off: the reference path), and a fair
    # share of each step's tokens when users' work exceeds them.
    shortcuts: bool = True
    fair_step_tokens: bool = True
    # Prompt tokens computed per second, per user (None: not limited).
    prompt_limits: PromptLimits | None = None
    # Teams over users: each team's limit and members (None: no teams).
    teams: Teams | None = None

    def ceiling_of(self, user: str) -> float:
        return self.user_rates.get(user, self.default_rate)

    def to_additional_config(self) -> dict[str, Any]:
        """The canonical form stored in ``additional_config["output_rate"]``."""
        return {
            DEFAULT_KEY: self.default_rate,
            USERS_KEY: dict(self.user_rates),
            FILE_KEY: self.config_file,
            METRICS_USERS_KEY: list(self.metrics_users),
            METRICS_RECENT_KEY: self.metrics_recent_users,
            WEIGHTS_KEY: dict(self.user_weights),
            FLOORS_KEY: dict(self.user_floors),
            CAPACITY_KEY: self.engine_capacity,
            SHORTCUTS_KEY: self.shortcuts,
            FAIR_STEP_TOKENS_KEY: self.fair_step_tokens,
            **(self.prompt_limits.to_config() if self.prompt_limits else {}),
            **(self.teams.to_config() if self.teams else {}),
            **(self.store.to_config() if self.store else {}),
        }

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None
    ) -> OutputRateSettings | None:
        """Parse ``additional_config``; None when rate limiting is not enabled."""
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if section is None:
            return None
        where = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
        check_object(
            section,
            (
                DEFAULT_KEY,
                USERS_KEY,
                FILE_KEY,
                METRICS_USERS_KEY,
                METRICS_RECENT_KEY,
                *FAIR_KEYS,
                SHORTCUTS_KEY,
                FAIR_STEP_TOKENS_KEY,
                *PROMPT_KEYS,
                TEAMS_KEY,
                *STORE_KEYS,
                *ADMISSION_KEYS,  # read by integration/admission_rpc.py
            ),
            where,
        )
        switches = {
            key: validate_switch(section.get(key, True), f"{where}[{key!r}]")
            for key in (SHORTCUTS_KEY, FAIR_STEP_TOKENS_KEY)
        }
        settings = merge_settings(
            config_file=section.get(FILE_KEY),
            default_rate=section.get(DEFAULT_KEY),
            user_rates=section.get(USERS_KEY),
            store=StoreSettings.from_config(section, where),
            default_source=f"{where}[{DEFAULT_KEY!r}]",
            users_source=f"{where}[{USERS_KEY!r}]",
            weights=section.get(WEIGHTS_KEY),
            floors=section.get(FLOORS_KEY),
            capacity=section.get(CAPACITY_KEY),
            fair_source=where,
        )
        if settings is None:
            if any(section.get(key) is not None for key in (*PROMPT_KEYS, TEAMS_KEY)):
                raise OutputRateConfigError(
                    f"{where}: prompt-token rates and teams need {DEFAULT_KEY!r} too"
                )
            return None
        teams = layered_teams(
            file_teams(settings.config_file),
            parse_teams(section.get(TEAMS_KEY), f"{where}[{TEAMS_KEY!r}]"),
        )
        check_team_floors(teams, settings.user_floors, settings.engine_capacity)
        return replace(
            settings,
            teams=teams,
            shortcuts=switches[SHORTCUTS_KEY],
            fair_step_tokens=switches[FAIR_STEP_TOKENS_KEY],
            prompt_limits=prompt_limits_from(
                section, where, file_prompt_rates(settings.config_file)
            ),
        ).with_metrics_labels(
            section.get(METRICS_USERS_KEY),
            section.get(METRICS_RECENT_KEY),
            users_source=f"{where}[{METRICS_USERS_KEY!r}]",
            recent_source=f"{where}[{METRICS_RECENT_KEY!r}]",
        )

    def with_metrics_labels(
        self,
        users: object = None,
        recent: object = None,
        *,
        users_source: str = METRICS_USERS_FLAG,
        recent_source: str = METRICS_RECENT_FLAG,
    ) -> OutputRateSettings:
        """These settings with the metrics label settings given (None: keep)."""
        return replace(
            self,
            metrics_users=self.metrics_users
            if users is None
            else parse_metrics_users(users, users_source),
            metrics_recent_users=self.metrics_recent_users
            if recent is None
            else validate_recent_users(recent, recent_source),
        )


def _read_limits_file(path: str | Path) -> Mapping[str, Any]:
    where = f"{FILE_FLAG} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise OutputRateConfigError(f"{where}: cannot read: {exc.strerror}") from None
    try:
        content = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise OutputRateConfigError(f"{where}: not valid YAML/JSON: {exc}") from None
    if content is None:
        content = {}
    return check_object(
        content,
        (
            DEFAULT_KEY,
            USERS_KEY,
            WEIGHTS_KEY,
            FLOORS_KEY,
            *PROMPT_KEYS,
            TEAMS_KEY,
            *STORE_KEYS,
            *ADMISSION_KEYS,
        ),
        where,
    )


def load_fair_shares(path: str | Path) -> tuple[dict[str, float], dict[str, float]]:
    """The weights and floors of a limits file (reloaded with its limits)."""
    return _fair_shares_in(_read_limits_file(path), f"{FILE_FLAG} {path}")


def _fair_shares_in(
    content: Mapping[str, Any], where: str
) -> tuple[dict[str, float], dict[str, float]]:
    return (
        parse_user_weights(content.get(WEIGHTS_KEY) or {}, f"{where}: {WEIGHTS_KEY}"),
        parse_user_rates(content.get(FLOORS_KEY) or {}, f"{where}: {FLOORS_KEY}"),
    )


def load_store_settings(path: str | Path) -> StoreSettings | None:
    """The shared-store settings of a limits file (read at start-up only)."""
    return StoreSettings.from_config(_read_limits_file(path), f"{FILE_FLAG} {path}")


def load_limits_file(path: str | Path) -> tuple[float | None, dict[str, float]]:
    """Read a JSON or YAML limits file (YAML is a superset of JSON).

    Format::

        default_user_output_tokens_per_second: 100
        user_output_tokens_per_second:
          user-a: 100
          user-b: 500

    It may also hold the ``store_*`` settings (see ``store/settings.py``),
    which are read at start-up and not reloaded.
    """
    return _limits_in(_read_limits_file(path), f"{FILE_FLAG} {path}")


def _limits_in(
    content: Mapping[str, Any], where: str
) -> tuple[float | None, dict[str, float]]:
    default = content.get(DEFAULT_KEY)
    return (
        None if default is None else validate_rate(default, f"{where}: {DEFAULT_KEY}"),
        parse_user_rates(content.get(USERS_KEY) or {}, f"{where}: {USERS_KEY}"),
    )


def file_prompt_rates(config_file: str | None) -> Rates:
    """A limits file's prompt rates (none without a file)."""
    if not config_file:
        return NO_RATES
    return prompt_rates_in(_read_limits_file(config_file), f"{FILE_FLAG} {config_file}")


@dataclass(frozen=True)
class FileLimits:
    """What a limits file states that is reloaded while the server runs."""

    default: float | None
    users: dict[str, float]
    weights: dict[str, float]
    floors: dict[str, float]
    prompt: Rates
    teams: Teams | None  # None: the file states none


def read_file_limits(path: str | Path) -> FileLimits:
    """All of it from one read of the file, so that a file written
    meanwhile is never half applied; raises OutputRateConfigError."""
    content, where = _read_limits_file(path), f"{FILE_FLAG} {path}"
    return FileLimits(
        *_limits_in(content, where),
        *_fair_shares_in(content, where),
        prompt_rates_in(content, where),
        parse_teams(content.get(TEAMS_KEY), f"{where}: {TEAMS_KEY}"),
    )


def file_teams(config_file: str | None) -> Teams | None:
    """A limits file's teams (none without a file)."""
    if not config_file:
        return None
    path = f"{FILE_FLAG} {config_file}"
    return parse_teams(_read_limits_file(config_file).get(TEAMS_KEY), f"{path}: teams")


def merge_settings(
    *,
    config_file: str | None = None,
    default_rate: object = None,
    user_rates: object = None,
    store: StoreSettings | None = None,
    default_source: str = DEFAULT_FLAG,
    users_source: str = USERS_FLAG,
    weights: object = None,
    floors: object = None,
    capacity: object = None,
    fair_source: str | None = None,
) -> OutputRateSettings | None:
    """Combine a limits file with explicit values (explicit values win).

    Returns None when no default rate is given anywhere: the feature is off.
    The ``*_source`` names go into error messages.
    """
    if store is None and config_file:
        store = load_store_settings(config_file)
    file_default, merged_users = (
        load_limits_file(config_file) if config_file else (None, {})
    )
    if user_rates is not None:
        merged_users.update(parse_user_rates(user_rates, users_source))
    if default_rate is not None:
        default = validate_rate(default_rate, default_source)
    elif file_default is not None:
        default = file_default
    elif merged_users or store is not None:
        given = f"{users_source} (or a limits file)" if merged_users else "A store"
        raise OutputRateConfigError(
            f"{given} was given without {DEFAULT_FLAG}: "
            "per-user limits need a default for everyone else"
        )
    elif weights or floors or capacity is not None:
        raise OutputRateConfigError(
            f"{WEIGHTS_FLAG}, {FLOORS_FLAG} and {CAPACITY_FLAG} need {DEFAULT_FLAG}"
        )
    elif any(file_prompt_rates(config_file)):
        raise OutputRateConfigError(
            f"{FILE_FLAG} {config_file}: prompt-token rates need {DEFAULT_FLAG}"
        )
    else:
        return None
    merged_weights, merged_floors = (
        load_fair_shares(config_file) if config_file else ({}, {})
    )
    weights_where = f"{fair_source}[{WEIGHTS_KEY!r}]" if fair_source else WEIGHTS_FLAG
    floors_where = f"{fair_source}[{FLOORS_KEY!r}]" if fair_source else FLOORS_FLAG
    capacity_where = f"{fair_source}[{CAPACITY_KEY!r}]" if fair_source else None
    if weights is not None:
        merged_weights.update(parse_user_weights(weights, weights_where))
    if floors is not None:
        merged_floors.update(parse_user_rates(floors, floors_where))
    settings = OutputRateSettings(
        default_rate=default,
        user_rates=merged_users,
        config_file=str(config_file) if config_file else None,
        store=store,
        user_weights=merged_weights,
        user_floors=merged_floors,
        engine_capacity=None
        if capacity is None
        else validate_rate(capacity, capacity_where or CAPACITY_FLAG),
    )
    check_floors(
        merged_floors, settings.ceiling_of, settings.engine_capacity, floors_where
    )
    return settings
