"""Per-user prompt-token rates: the settings (no vLLM import).

A user's *prompt tokens computed* (prefill, and recomputation after a
preemption) can be paced like its output tokens: a GCRA budget per user,
in tokens per second, with the same 100 ms burst. Prefix-cache hits cost
the engine nothing and are never charged. The keys sit beside the output
limits in ``additional_config['output_rate']`` (or a limits file) and have
flags of their own (``integration/prompt_flags.py``):

* ``default_user_prompt_tokens_per_second``: every user's prompt rate;
* ``user_prompt_tokens_per_second``: per-user rates (``{"batch": 2000}``),
  which need the default.

Without the default, prompt tokens are not limited. How a step enforces
them: ``scheduling/prompt_budget.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.validation import (
    OutputRateConfigError,
    parse_user_rates,
    validate_rate,
)

DEFAULT_PROMPT_KEY = "default_user_prompt_tokens_per_second"
PROMPT_USERS_KEY = "user_prompt_tokens_per_second"
PROMPT_KEYS = (DEFAULT_PROMPT_KEY, PROMPT_USERS_KEY)
DEFAULT_PROMPT_FLAG = "--default-user-prompt-tokens-per-second"
PROMPT_USERS_FLAG = "--user-prompt-tokens-per-second"


@dataclass(frozen=True)
class PromptLimits:
    """Prompt tokens per second: ``default_rate`` for every user, and the
    users with a rate of their own."""

    default_rate: float
    user_rates: Mapping[str, float] = field(default_factory=dict)

    def to_config(self) -> dict[str, Any]:
        """The keys of ``additional_config['output_rate']`` that say it."""
        return {
            DEFAULT_PROMPT_KEY: self.default_rate,
            PROMPT_USERS_KEY: dict(self.user_rates),
        }


def prompt_rates_in(
    section: Mapping[str, Any], where: str
) -> tuple[float | None, dict[str, float]]:
    """The prompt rates ``section`` (an ``output_rate`` section or a limits
    file) states, checked: its default (None when absent) and its users'."""
    default = section.get(DEFAULT_PROMPT_KEY)
    return (
        None
        if default is None
        else validate_rate(default, f"{where}[{DEFAULT_PROMPT_KEY!r}]"),
        parse_user_rates(
            section.get(PROMPT_USERS_KEY) or {}, f"{where}[{PROMPT_USERS_KEY!r}]"
        ),
    )


# A source's prompt rates: its default (None when it gives none) and users'.
Rates = tuple[float | None, Mapping[str, float]]
NO_RATES: Rates = (None, {})


def rates_of(limits: PromptLimits | None) -> Rates:
    return NO_RATES if limits is None else (limits.default_rate, limits.user_rates)


def combine(*layers: Rates, no_default: str) -> PromptLimits | None:
    """The prompt limits of ``layers``, later ones winning (a default over a
    default, a user's rate over the same user's); None when none gives a
    default, and users without one raise ``no_default``."""
    default: float | None = None
    users: dict[str, float] = {}
    for layer_default, layer_users in layers:
        default = default if layer_default is None else layer_default
        users.update(layer_users)
    if default is None:
        if users:
            raise OutputRateConfigError(no_default)
        return None
    return PromptLimits(default, users)


def prompt_limits_from(
    section: Mapping[str, Any], where: str, file: Rates = NO_RATES
) -> PromptLimits | None:
    """The prompt limits in an ``output_rate`` section over a limits file's
    rates (``file``); None without a default prompt rate in either.
    ``where`` names the section in errors."""
    return combine(
        file,
        prompt_rates_in(section, where),
        no_default=f"{where}[{PROMPT_USERS_KEY!r}] (or the limits file's) was "
        f"given without {DEFAULT_PROMPT_KEY!r}: per-user prompt rates need a "
        "default for everyone else",
    )
