"""The flag of teams over users (``teams.py``).

``--output-rate-teams JSON`` joins the plugin's group; each team it names
wins over the same team of ``--additional-config`` and the limits file.
Like every limit it needs output limiting on
(``--default-user-output-tokens-per-second``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from vllm_output_rate.config import DEFAULT_FLAG, OutputRateSettings
from vllm_output_rate.integration.cli_flags import plugin_group
from vllm_output_rate.integration.flag_types import parsed_with
from vllm_output_rate.teams import (
    TEAMS_FLAG,
    check_team_floors,
    layered_teams,
    parse_teams,
)
from vllm_output_rate.validation import OutputRateConfigError


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the teams flag to the plugin's group (once)."""
    if TEAMS_FLAG in parser._option_string_actions:
        return
    plugin_group(parser).add_argument(
        TEAMS_FLAG,
        type=parsed_with(parse_teams, TEAMS_FLAG),
        default=None,
        metavar="JSON",
        help="Teams over users: each team's output-token limit and members, e.g. "
        '\'{"research": {"output_tokens_per_second": 100, "members": ["alice", '
        "\"bob\"]}}'. A member is charged to its own limit and to its team's; "
        "a token is sampled only when both allow it.",
    )


def with_team_flags(
    args: argparse.Namespace, settings: OutputRateSettings | None
) -> OutputRateSettings | None:
    """``settings`` with the teams of the flag, if given (refused without
    output limiting)."""
    teams = getattr(args, "output_rate_teams", None)
    if teams is None:
        return settings
    if settings is None:
        settings = OutputRateSettings.from_additional_config(
            getattr(args, "additional_config", None)
        )
    if settings is None:
        raise OutputRateConfigError(f"{TEAMS_FLAG} needs {DEFAULT_FLAG}")
    teams = layered_teams(settings.teams, teams)
    check_team_floors(teams, settings.user_floors, settings.engine_capacity)
    return replace(settings, teams=teams)
