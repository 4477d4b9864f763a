"""Prompt-token rates from vLLM's own parser and from ``additional_config``:
good values reach the engine's settings, bad ones and options nothing would
apply are refused at start-up naming the option."""

from __future__ import annotations

import json

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness.vllm_cli import engine_settings, parse_engine_args, vllm_parser
from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.prompt_limits import PromptLimits
from vllm_output_rate.validation import OutputRateConfigError

FLAG = "--default-user-output-tokens-per-second"
PROMPT = "--default-user-prompt-tokens-per-second"
PROMPT_USERS = "--user-prompt-tokens-per-second"


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return vllm_parser()


def prompt_limits(parser, model: str, *argv: str) -> PromptLimits | None:
    return engine_settings(parser, model, *argv).prompt_limits


def test_the_flags_reach_the_engines_settings(parser, tiny_model_path: str) -> None:
    limits = prompt_limits(
        parser,
        tiny_model_path,
        FLAG,
        "10",
        PROMPT,
        "2000",
        PROMPT_USERS,
        '{"batch": 500}',
    )
    assert limits == PromptLimits(2000.0, {"batch": 500.0})
    assert prompt_limits(parser, tiny_model_path, FLAG, "10") is None


def test_flags_win_over_additional_config(parser, tiny_model_path: str) -> None:
    section = {
        "default_user_output_tokens_per_second": 10,
        "default_user_prompt_tokens_per_second": 100,
        "user_prompt_tokens_per_second": {"a": 1, "b": 2},
    }
    config = json.dumps({"output_rate": section})
    argv = ("--additional-config", config, PROMPT_USERS, '{"b": 20}')
    limits = prompt_limits(parser, tiny_model_path, *argv)
    assert limits == PromptLimits(100.0, {"a": 1.0, "b": 20.0})
    # The section alone, and with the output flag beside it.
    assert prompt_limits(
        parser, tiny_model_path, "--additional-config", config
    ) == PromptLimits(100.0, {"a": 1.0, "b": 2.0})
    limits = prompt_limits(
        parser, tiny_model_path, "--additional-config", config, FLAG, "20"
    )
    assert limits == PromptLimits(100.0, {"a": 1.0, "b": 2.0})


def test_bad_values_are_refused_by_the_parser(parser, tiny_model_path: str) -> None:
    for argv in (
        [PROMPT, "0"],
        [PROMPT, "fast"],
        [PROMPT, "inf"],
        [PROMPT_USERS, '{"a": -1}'],
        [PROMPT_USERS, "[1]"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", tiny_model_path, FLAG, "10", *argv])


def test_options_nothing_would_apply_are_refused(parser, tiny_model_path: str) -> None:
    with pytest.raises(OutputRateConfigError, match=f"need {FLAG}"):
        parse_engine_args(parser, tiny_model_path, PROMPT, "100")
    with pytest.raises(OutputRateConfigError, match="without"):
        parse_engine_args(parser, tiny_model_path, FLAG, "10", PROMPT_USERS, '{"a": 1}')


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"default_user_prompt_tokens_per_second": 0}, "finite number > 0"),
        ({"default_user_prompt_tokens_per_second": "x"}, "tokens per second"),
        ({"user_prompt_tokens_per_second": {"a": 1}}, "need a default"),
        (
            {
                "default_user_prompt_tokens_per_second": 5,
                "user_prompt_tokens_per_second": {"": 1},
            },
            "user",
        ),
    ],
)
def test_bad_additional_config_names_the_key(section: dict, message: str) -> None:
    config = {"output_rate": {"default_user_output_tokens_per_second": 10, **section}}
    with pytest.raises(OutputRateConfigError, match=message):
        OutputRateSettings.from_additional_config(config)


def test_prompt_rates_without_limiting_are_refused() -> None:
    config = {"output_rate": {"default_user_prompt_tokens_per_second": 5}}
    with pytest.raises(OutputRateConfigError, match="need"):
        OutputRateSettings.from_additional_config(config)


def test_the_settings_round_trip_through_additional_config() -> None:
    settings = OutputRateSettings(
        default_rate=10.0, prompt_limits=PromptLimits(300.0, {"a": 30.0})
    )
    again = OutputRateSettings.from_additional_config(
        {"output_rate": settings.to_additional_config()}
    )
    assert again is not None and again.prompt_limits == settings.prompt_limits


def test_a_limits_file_gives_prompt_rates_and_flags_win(
    parser, tiny_model_path: str, tmp_path
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_user_output_tokens_per_second: 100\n"
        "default_user_prompt_tokens_per_second: 3000\n"
        "user_prompt_tokens_per_second: {hog: 500, batch: 800}\n"
    )
    file = ("--output-rate-config", str(limits))
    assert prompt_limits(parser, tiny_model_path, *file) == PromptLimits(
        3000.0, {"hog": 500.0, "batch": 800.0}
    )
    assert prompt_limits(
        parser, tiny_model_path, *file, PROMPT, "900", PROMPT_USERS, '{"hog": 50}'
    ) == PromptLimits(900.0, {"hog": 50.0, "batch": 800.0})
    # The file's users over a default given by the flag alone.
    limits.write_text(
        "default_user_output_tokens_per_second: 100\n"
        "user_prompt_tokens_per_second: {hog: 500}\n"
    )
    with pytest.raises(OutputRateConfigError, match="need a default"):
        prompt_limits(parser, tiny_model_path, *file)
    assert prompt_limits(parser, tiny_model_path, *file, PROMPT, "900") == PromptLimits(
        900.0, {"hog": 500.0}
    )


def test_a_limits_file_with_prompt_rates_needs_output_limiting(tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text("default_user_prompt_tokens_per_second: 3000\n")
    config = {"output_rate": {"config_file": str(limits)}}
    with pytest.raises(OutputRateConfigError, match="prompt-token rates need"):
        OutputRateSettings.from_additional_config(config)


def test_the_api_server_refuses_prompt_rate_changes_while_off(monkeypatch) -> None:
    # The admin API's PUT is checked in the API server before the engine:
    # prompt rates are refused (HTTP 400) unless prompt limiting is on.
    from vllm_output_rate.integration import engine_setup
    from vllm_output_rate.integration.admission_setup import check_limits_update
    from vllm_output_rate.limits_update import PROMPT_OFF

    body = {"user_prompt_tokens_per_second": {"hog": 100}}
    monkeypatch.setattr(engine_setup, "prompt_limiting_enabled", False)
    with pytest.raises(OutputRateConfigError) as refused:
        check_limits_update(body, plugin=None)
    assert str(refused.value) == PROMPT_OFF
    check_limits_update({"user_output_tokens_per_second": {"hog": 5}}, plugin=None)
    monkeypatch.setattr(engine_setup, "prompt_limiting_enabled", True)
    check_limits_update(body, plugin=None)
    with pytest.raises(OutputRateConfigError, match="got -1"):
        check_limits_update({"user_prompt_tokens_per_second": {"a": -1}}, None)


def test_start_up_tells_the_api_server_whether_prompt_limiting_is_on(
    parser, tiny_model_path: str, monkeypatch
) -> None:
    from vllm_output_rate.integration import engine_setup

    monkeypatch.setattr(engine_setup, "prompt_limiting_enabled", True)  # restored

    for argv, on in (((FLAG, "10"), False), ((FLAG, "10", PROMPT, "900"), True)):
        parse_engine_args(parser, tiny_model_path, *argv)
        assert engine_setup.prompt_limiting_enabled is on
