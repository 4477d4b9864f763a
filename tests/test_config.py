"""Settings parsing: the one validator, the limits update, precedence."""

from __future__ import annotations

import re

import pytest

from vllm_output_rate.config import (
    OutputRateSettings,
    merge_settings,
)
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.limits_update import LimitsUpdate, parse_limits_update
from vllm_output_rate.validation import (
    MAX_USER_NAME_LENGTH,
    OutputRateConfigError,
    parse_user_rates,
    validate_rate,
    validate_user_name,
)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (5, "must be a string"),
        (None, "must be a string"),
        ("", "must not be empty"),
        ("x" * (MAX_USER_NAME_LENGTH + 1), "the limit is 256"),
        ("tab\there", "control character"),
        ("nul\x00", "control character"),
        ("esc\x1b[2J", "control character"),
        ("del\x7f", "control character"),
        ("c1\x9b", "control character"),
    ],
)
def test_one_rule_for_user_names_everywhere(name: object, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message):
        validate_user_name(name, "somewhere")
    with pytest.raises(OutputRateConfigError, match=message):
        parse_user_rates({name: 1}, "flag") if isinstance(name, str) else (
            validate_user_name(name)
        )
    if isinstance(name, str):
        with pytest.raises(ValueError, match=message):
            OutputRateLimiter(1, {name: 1})


def test_names_may_hold_any_printable_text() -> None:
    for name in ("user-a", "alice@example.com", "Zoë 🙂", "a b", "x" * 256):
        assert validate_user_name(name) == name


def test_the_longest_allowed_name_is_accepted_everywhere() -> None:
    name = "u" * MAX_USER_NAME_LENGTH
    assert validate_user_name(name) == name
    assert parse_limits_update({"user_output_tokens_per_second": {name: 3}})
    OutputRateLimiter(1, {name: 1})


@pytest.mark.parametrize("rate", [0, -1, float("inf"), float("nan"), True, "5"])
def test_rates_must_be_finite_positive_numbers(rate: object) -> None:
    with pytest.raises(OutputRateConfigError):
        validate_rate(rate, "rate")


def test_a_limits_update_with_every_field() -> None:
    update = parse_limits_update(
        {
            "default_user_output_tokens_per_second": 80,
            "user_output_tokens_per_second": {"a": 10, "b": 2.5},
            "remove_users": ["c"],
        }
    )
    assert update == LimitsUpdate(80.0, {"a": 10.0, "b": 2.5}, ("c",))
    assert parse_limits_update({}) == LimitsUpdate()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "expected an object"),
        ({"bogus": 1}, "unknown keys"),
        ({"default_user_output_tokens_per_second": 0}, "> 0"),
        ({"user_output_tokens_per_second": {"a": "fast"}}, "number"),
        ({"user_output_tokens_per_second": []}, "JSON object"),
        ({"remove_users": "a"}, "expected a list"),
        ({"remove_users": [""]}, "must not be empty"),
    ],
)
def test_a_bad_limits_update_names_the_field(payload: object, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message):
        parse_limits_update(payload)


def test_explicit_values_win_over_the_limits_file(tmp_path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        "default_user_output_tokens_per_second: 7\n"
        "user_output_tokens_per_second: {a: 1, b: 2}\n"
    )
    settings = merge_settings(
        config_file=str(path), default_rate=9, user_rates='{"b": 20}'
    )
    assert settings is not None
    assert settings.default_rate == 9
    assert settings.user_rates == {"a": 1, "b": 20}


def test_no_default_anywhere_means_limiting_is_off() -> None:
    assert merge_settings() is None
    with pytest.raises(OutputRateConfigError, match="need a default"):
        merge_settings(user_rates={"a": 1})


def test_metrics_label_settings_are_validated() -> None:
    from vllm_output_rate.config import OutputRateSettings

    base = OutputRateSettings(default_rate=5)
    assert base.metrics_recent_users == 100 and base.metrics_users == ()
    settings = base.with_metrics_labels('["vip", "vip", "b"]', "7")
    assert settings.metrics_users == ("vip", "b")  # duplicates dropped
    assert settings.metrics_recent_users == 7
    round_trip = OutputRateSettings.from_additional_config(
        {"output_rate": settings.to_additional_config()}
    )
    assert round_trip == settings
    for users, message in (
        ("vip", "not valid JSON"),
        ('{"vip": 1}', "expected a JSON list"),
        ('[""]', "must not be empty"),
        ("[5]", "must be a string"),
    ):
        with pytest.raises(OutputRateConfigError, match=message):
            base.with_metrics_labels(users=users)
    for recent in (-1, 10_001, 2.5, True, "many", "-3"):
        with pytest.raises(OutputRateConfigError, match="0 to 10,000"):
            base.with_metrics_labels(recent=recent)
    with pytest.raises(OutputRateConfigError, match="unknown keys"):
        OutputRateSettings.from_additional_config(
            {"output_rate": {"default_user_output_tokens_per_second": 1, "metrics": 2}}
        )


# ----- fair shares --------------------------------------------------------------


def test_fair_shares_round_trip_through_additional_config() -> None:
    settings = merge_settings(
        default_rate=100,
        user_rates={"gold": 400},
        weights='{"gold": 3}',
        floors={"gold": 250},
        capacity=1000,
    )
    assert settings is not None
    again = OutputRateSettings.from_additional_config(
        {"output_rate": settings.to_additional_config()}
    )
    assert again == settings
    assert again.user_weights == {"gold": 3.0} and again.engine_capacity == 1000.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"floors": {"a": 150}}, "floor of user 'a' (150 tok/s) is above its limit"),
        (
            {"floors": {"a": 60, "b": 50}, "capacity": 100},
            "floors sum to 110 tok/s, more than the engine capacity",
        ),
        ({"weights": {"a": -1}}, "weight of user 'a' must be a finite number > 0"),
        ({"weights": {"a": True}}, "must be a number"),
        ({"capacity": 0}, "got 0"),
    ],
)
def test_fair_shares_that_cannot_be_kept_are_refused(kwargs, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=re.escape(message)):
        merge_settings(default_rate=100, **kwargs)


def test_fair_shares_need_a_default_rate() -> None:
    with pytest.raises(OutputRateConfigError, match="need --default-user"):
        merge_settings(weights={"a": 2})


def test_the_limits_file_holds_weights_and_floors(tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_user_output_tokens_per_second: 100\n"
        "user_output_weight: {a: 2, b: 0.5}\n"
        "user_min_output_tokens_per_second: {a: 20}\n"
    )
    settings = merge_settings(config_file=str(limits), weights={"b": 1})
    assert settings is not None
    assert settings.user_weights == {"a": 2.0, "b": 1.0}  # the flag wins
    assert settings.user_floors == {"a": 20.0}


def test_a_limits_update_carries_weights_and_floors() -> None:
    update = parse_limits_update(
        {"user_output_weight": {"a": 2}, "user_min_output_tokens_per_second": {"a": 5}}
    )
    assert update.user_weights == {"a": 2.0} and update.user_floors == {"a": 5.0}
    with pytest.raises(OutputRateConfigError, match="user_output_weight"):
        parse_limits_update({"user_output_weight": {"a": 0}})


@pytest.mark.parametrize("key", ["shortcuts", "fair_step_tokens"])
@pytest.mark.parametrize("value", ["false", 0, 1, None, [], "yes"])
def test_a_switch_is_true_or_false_and_nothing_else(key: str, value: object) -> None:
    section = {"default_user_output_tokens_per_second": 5, key: value}
    with pytest.raises(OutputRateConfigError, match=rf"\['{key}'\] must be true or"):
        OutputRateSettings.from_additional_config({"output_rate": section})
    off = {"default_user_output_tokens_per_second": 5, key: False}
    settings = OutputRateSettings.from_additional_config({"output_rate": off})
    assert settings is not None and getattr(settings, key) is False
    assert settings.to_additional_config()[key] is False
