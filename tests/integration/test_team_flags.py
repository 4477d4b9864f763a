"""Teams from vLLM's own parser and from ``additional_config``: good values
reach the engine's settings, bad ones are refused at start-up naming the
option and the value."""

from __future__ import annotations

import json

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness.vllm_cli import engine_settings, parse_engine_args, vllm_parser
from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.teams import TEAMS_FLAG, Teams, check_team_floors, parse_teams
from vllm_output_rate.validation import OutputRateConfigError

FLAG = "--default-user-output-tokens-per-second"
RESEARCH = {"research": {"output_tokens_per_second": 100, "members": ["a", "b"]}}


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return vllm_parser()


def teams_of(parser, model: str, *argv: str) -> Teams | None:
    return engine_settings(parser, model, *argv).teams


def test_the_flag_reaches_the_engines_settings(parser, tiny_model_path: str) -> None:
    teams = teams_of(
        parser, tiny_model_path, FLAG, "10", TEAMS_FLAG, json.dumps(RESEARCH)
    )
    assert teams == Teams({"research": 100.0}, {"a": "research", "b": "research"})
    assert teams_of(parser, tiny_model_path, FLAG, "10") is None


def test_the_flag_wins_over_additional_config_team_by_team(
    parser, tiny_model_path: str
) -> None:
    section = {
        "default_user_output_tokens_per_second": 10,
        "teams": {"old": {"output_tokens_per_second": 5, "members": ["a"]}},
    }
    config = json.dumps({"output_rate": section})
    assert teams_of(parser, tiny_model_path, "--additional-config", config) == Teams(
        {"old": 5.0}, {"a": "old"}
    )
    teams = teams_of(
        parser,
        tiny_model_path,
        "--additional-config",
        config,
        TEAMS_FLAG,
        json.dumps(RESEARCH),
    )
    # Team by team: "old" stays, a moves to the flag's "research".
    assert teams == Teams(
        {"old": 5.0, "research": 100.0}, {"a": "research", "b": "research"}
    )


def test_teams_need_output_limiting(parser, tiny_model_path: str) -> None:
    with pytest.raises(OutputRateConfigError, match=f"{TEAMS_FLAG} needs {FLAG}"):
        parse_engine_args(parser, tiny_model_path, TEAMS_FLAG, json.dumps(RESEARCH))
    config = {"output_rate": {"teams": RESEARCH}}
    with pytest.raises(OutputRateConfigError, match="teams need"):
        OutputRateSettings.from_additional_config(config)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1, 2]", "expected an object of teams"),
        ('{"t": 5}', "expected an object with"),
        ('{"t": {"members": ["a"]}}', "'output_tokens_per_second' is missing"),
        ('{"t": {"output_tokens_per_second": 0}}', "finite number > 0"),
        ('{"t": {"output_tokens_per_second": 5, "members": "a"}}', "list of user"),
        ('{"t": {"output_tokens_per_second": 5, "priority": 2}}', "unknown key"),
        ('{"t": {"output_tokens_per_second": 5, "weight": 0}}', "weight"),
        ('{"t": {"output_tokens_per_second": 5, "weight": "x"}}', "weight"),
        ('{"t": {"output_tokens_per_second": 5, "weight": 1e9}}', "at most"),
        (
            '{"t": {"output_tokens_per_second": 5, "min_output_tokens_per_second": 6}}',
            "above the team's limit",
        ),
        (
            '{"t": {"output_tokens_per_second": 5,'
            ' "min_output_tokens_per_second": -1}}',
            "finite number > 0",
        ),
        ('{"t": {"output_tokens_per_second": 5, "members": ["a\\u0007"]}}', "control"),
        ('{"": {"output_tokens_per_second": 5}}', "must not be empty"),
        (
            '{"x": {"output_tokens_per_second": 5, "members": ["a"]},'
            ' "y": {"output_tokens_per_second": 5, "members": ["a"]}}',
            "already a member of team 'x'",
        ),
        ("{not json", "JSON"),
    ],
)
def test_bad_teams_are_refused_naming_the_option(value: str, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message) as refused:
        parse_teams(value, TEAMS_FLAG)
    assert TEAMS_FLAG in str(refused.value)


def test_a_name_of_10_kb_is_refused() -> None:
    value = {"t": {"output_tokens_per_second": 5, "members": ["u" * 10_000]}}
    with pytest.raises(OutputRateConfigError, match="the limit is 256"):
        parse_teams(value, TEAMS_FLAG)


def test_a_team_limit_below_its_members_floors_is_refused(
    parser, tiny_model_path: str
) -> None:
    floors = json.dumps({"a": 60, "b": 50})
    with pytest.raises(OutputRateConfigError, match="above the team's limit"):
        parse_engine_args(
            parser,
            tiny_model_path,
            FLAG,
            "1000",
            "--user-min-output-tokens-per-second",
            floors,
            TEAMS_FLAG,
            json.dumps(RESEARCH),
        )


def test_a_limits_files_teams_under_the_flags(
    parser, tiny_model_path: str, tmp_path
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_user_output_tokens_per_second: 10\n"
        "teams:\n"
        "  filed: {output_tokens_per_second: 7, members: [c]}\n"
        "  research: {output_tokens_per_second: 1, members: [z]}\n"
    )
    file = ("--output-rate-config", str(limits))
    assert teams_of(parser, tiny_model_path, *file) == Teams(
        {"filed": 7.0, "research": 1.0}, {"c": "filed", "z": "research"}
    )
    # The flag's research replaces the file's whole; filed stays.
    teams = teams_of(parser, tiny_model_path, *file, TEAMS_FLAG, json.dumps(RESEARCH))
    assert teams == Teams(
        {"filed": 7.0, "research": 100.0},
        {"c": "filed", "a": "research", "b": "research"},
    )


def test_team_floors_beyond_the_engines_capacity_are_refused() -> None:
    teams = parse_teams(
        '{"t": {"output_tokens_per_second": 500, "min_output_tokens_per_second": 300}}',
        TEAMS_FLAG,
    )
    check_team_floors(teams, {"u": 100.0}, capacity=1000.0)
    with pytest.raises(OutputRateConfigError, match="more than the engine capacity"):
        check_team_floors(teams, {"u": 100.0}, capacity=350.0)
