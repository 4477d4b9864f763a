"""Store settings: URLs, redaction, flags through vLLM's real parser, start-up."""

from __future__ import annotations

import json
import logging
import socket

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness.vllm_cli import parse_engine_args, vllm_parser
from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.integration.compat import check_supported_config
from vllm_output_rate.store.settings import (
    PASSWORD_ENV,
    StoreSettings,
    check_store_url,
    client_url,
    redact_url,
)
from vllm_output_rate.validation import OutputRateConfigError

FLAG = "--default-user-output-tokens-per-second"


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://user:pw@cache.example:6380",
        "valkey://h",
        "valkeys://h:1/2",
        "unix:///run/redis.sock",
    ],
)
def test_accepted_urls(url: str) -> None:
    assert check_store_url(url) == url
    assert client_url(url).split("://")[0] in {"redis", "rediss", "unix"}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "expected a URL"),
        (5, "expected a URL"),
        ("http://h:6379", "unsupported scheme 'http'"),
        ("h:6379", "unsupported scheme"),
        ("redis://", "no host"),
        ("redis://h:port/0", "port is not a number"),
        ("redis://h:99999", "port is not a number"),
        ("redis://h/db1", "database must be a number"),
        ("unix://", "needs a socket path"),
        ("redis://u:s3cret@h:x", "port"),
    ],
)
def test_malformed_urls_name_the_option(url: object, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message) as info:
        check_store_url(url)
    assert "--output-rate-store" in str(info.value)
    assert "s3cret" not in str(info.value)


def test_the_password_is_never_shown(monkeypatch) -> None:
    url = "redis://app:s3cret@h:6379/0"
    assert redact_url(url) == "redis://app:***@h:6379/0"
    settings = StoreSettings(url=url)
    assert "s3cret" not in repr(settings) and settings.password == "s3cret"
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert StoreSettings(url="redis://h").password == "from-env"
    assert settings.password == "s3cret"  # the URL's wins


def test_lease_timing_is_checked() -> None:
    with pytest.raises(OutputRateConfigError, match="at most half"):
        StoreSettings(url="redis://h", lease_s=0.1, refresh_s=0.1)
    with pytest.raises(OutputRateConfigError, match="fallback-share"):
        StoreSettings(url="redis://h", fallback_share=1.5)


def test_additional_config_round_trip_and_store_options_need_a_url() -> None:
    settings = OutputRateSettings.from_additional_config(
        {
            "output_rate": {
                "default_user_output_tokens_per_second": 10,
                "store_url": "valkey://h:6379",
                "store_fallback_share": 0.5,
            }
        }
    )
    assert settings is not None and settings.store is not None
    assert settings.store.fallback_share == 0.5
    again = OutputRateSettings.from_additional_config(
        {"output_rate": settings.to_additional_config()}
    )
    assert again == settings
    with pytest.raises(OutputRateConfigError, match="without store_url"):
        OutputRateSettings.from_additional_config(
            {
                "output_rate": {
                    "default_user_output_tokens_per_second": 1,
                    "store_lease_s": 3,
                }
            }
        )


def test_the_limits_file_may_name_the_store(tmp_path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        "default_user_output_tokens_per_second: 5\nstore_url: redis://h:1/0\n"
    )
    settings = OutputRateSettings.from_additional_config(
        {"output_rate": {"config_file": str(path)}}
    )
    assert settings is not None and settings.store is not None
    assert settings.store.url == "redis://h:1/0"


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return vllm_parser()


def engine_config(parser, model: str, *argv: str):
    return parse_engine_args(parser, model, *argv)


def test_flags_reach_the_engine_and_the_password_stays_out_of_logs(
    parser, tiny_model_path: str, redis_server, caplog
) -> None:
    url = redis_server.url.replace("redis://", "redis://:pw-in-url@")
    # The test server has no password: AUTH fails, which is reported as
    # a store that refused (and it names no password either).
    args, config = engine_config(
        parser,
        tiny_model_path,
        FLAG, "10",
        "--output-rate-store", redis_server.url,
        "--output-rate-store-fallback-share", "0.25",
    )  # fmt: skip
    settings = OutputRateSettings.from_additional_config(config.additional_config)
    assert settings is not None and settings.store is not None
    assert settings.store.url == redis_server.url
    assert settings.store.fallback_share == 0.25
    args = parser.parse_args(["--model", "m", FLAG, "1", "--output-rate-store", url])
    assert "pw-in-url" not in repr(vars(args)) and "pw-in-url" not in str(vars(args))
    plain = parser.parse_args(["--output-rate-store", redis_server.url, "--model", "m"])
    assert repr(plain.output_rate_store) == repr(redis_server.url)  # found: recursed


def test_store_flag_combines_with_store_settings_in_additional_config(
    parser, tiny_model_path: str, redis_server
) -> None:
    """An operator gives the URL as a flag and the tuning in the section."""
    section = {"store_timeout_s": 1.0, "store_key_prefix": "tuned"}
    _, config = engine_config(
        parser,
        tiny_model_path,
        FLAG, "10",
        "--output-rate-store", redis_server.url,
        "--additional-config", json.dumps({"output_rate": section}),
    )  # fmt: skip
    settings = OutputRateSettings.from_additional_config(config.additional_config)
    assert settings is not None and settings.store is not None
    assert settings.store.url == redis_server.url
    assert (settings.store.timeout_s, settings.store.key_prefix) == (1.0, "tuned")
    # Without the flag the section's store settings still need a URL.
    args = parser.parse_args(
        [
            "--model",
            "m",
            FLAG,
            "1",
            "--additional-config",
            json.dumps({"output_rate": section}),
        ]
    )
    with pytest.raises(OutputRateConfigError, match="without store_url"):
        AsyncEngineArgs.from_cli_args(args)


def test_store_flags_without_limits_or_url_are_refused(parser) -> None:
    for argv in (
        ["--output-rate-store", "redis://h"],
        [FLAG, "1", "--output-rate-store-required"],
    ):
        args = parser.parse_args(["--model", "m", *argv])
        with pytest.raises(OutputRateConfigError, match="need"):
            AsyncEngineArgs.from_cli_args(args)


def test_data_parallel_needs_a_store(parser, tiny_model_path: str) -> None:
    _, config = engine_config(parser, tiny_model_path, FLAG, "10")
    config.parallel_config.data_parallel_size = 2
    with pytest.raises(OutputRateConfigError, match="without --output-rate-store"):
        check_supported_config(config)
    check_supported_config(config, store=True)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_store_starts_in_fallback_unless_required(
    parser, tiny_model_path: str, caplog
) -> None:
    url = f"redis://127.0.0.1:{unused_port()}/0"
    with caplog.at_level(logging.WARNING, logger="vllm.output_rate"):
        engine_config(parser, tiny_model_path, FLAG, "10", "--output-rate-store", url)
    assert "Starting anyway" in caplog.text
    with pytest.raises(OutputRateConfigError, match="refuses to start"):
        engine_config(
            parser, tiny_model_path, FLAG, "10",
            "--output-rate-store", url, "--output-rate-store-required",
        )  # fmt: skip
