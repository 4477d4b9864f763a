"""The identity flags from vLLM's own parser: good values become the HTTP
plugin's policy, bad ones and options nothing would apply are refused at
start-up naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness.vllm_cli import parse_engine_args, vllm_parser
from vllm_output_rate.api_keys import digest
from vllm_output_rate.integration.http_plugin import identity_policy
from vllm_output_rate.integration.identity_flags import (
    parse_body_fields,
    parse_header_name,
)
from vllm_output_rate.integration.trusted_identity import IdentityPolicy
from vllm_output_rate.validation import OutputRateConfigError

FLAG = "--default-user-output-tokens-per-second"
HEADER = "--output-rate-user-header"
FIELDS = "--output-rate-user-fields"
SALT = "--output-rate-cache-salt"
KEYS = "--output-rate-api-keys"


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return vllm_parser()


@pytest.fixture
def http_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "output_rate,output_rate_http")


def keys_file(tmp_path: Path, gateway: bool) -> str:
    path = tmp_path / "keys.yaml"
    entry = f"{{keys: [{digest('g')}], gateway: {str(gateway).lower()}}}"
    path.write_text(f"litellm: {entry}\nalice: [{digest('a')}]\n")
    return str(path)


def test_header_names() -> None:
    assert parse_header_name("X-LiteLLM-End-User-Id") == "x-litellm-end-user-id"
    assert parse_header_name("x-litellm-user_api_key_end_user_id") == (
        "x-litellm-user_api_key_end_user_id"
    )
    for bad in ("", "x user", "x:y", "é"):
        with pytest.raises(OutputRateConfigError, match="not an HTTP header"):
            parse_header_name(bad)
    for reserved in ("Authorization", "cookie", "host", "content-length"):
        with pytest.raises(OutputRateConfigError, match="something else"):
            parse_header_name(reserved)


def test_body_fields() -> None:
    assert parse_body_fields("safety_identifier,user") == ("safety_identifier", "user")
    assert parse_body_fields(" user ") == ("user",)
    for bad in ("", "user,user", "vllm_xargs", "user,metadata"):
        with pytest.raises(OutputRateConfigError, match=FIELDS):
            parse_body_fields(bad)


def test_the_flags_become_the_plugins_policy(
    parser, tiny_model_path: str, tmp_path: Path, http_plugin: None
) -> None:
    keys = keys_file(tmp_path, gateway=True)
    argv = [FLAG, "10", KEYS, keys, HEADER, "X-End-User", FIELDS, "user", SALT, "user"]
    args, _ = parse_engine_args(parser, tiny_model_path, *argv)
    policy = identity_policy(args)
    assert policy is not None
    assert (policy.header, policy.body_fields, policy.cache_salt) == (
        "x-end-user",
        ("user",),
        True,
    )
    assert policy.keys is not None and policy.keys.principal_for("g").gateway
    # The salt alone, and nothing at all.
    args, _ = parse_engine_args(parser, tiny_model_path, FLAG, "10", SALT, "user")
    assert identity_policy(args) == IdentityPolicy(cache_salt=True)
    args, _ = parse_engine_args(parser, tiny_model_path, FLAG, "10")
    assert identity_policy(args) is None


def test_bad_values_are_refused_by_the_parser(parser, tiny_model_path: str) -> None:
    for argv in ([HEADER, "authorization"], [FIELDS, "name"], [SALT, "team"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", tiny_model_path, *argv])


def test_options_nothing_would_apply_are_refused(
    parser, tiny_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def start(*argv: str) -> None:
        parse_engine_args(parser, tiny_model_path, *argv)

    monkeypatch.setenv("VLLM_PLUGINS", "output_rate,output_rate_http")
    for flag, value in ((HEADER, "x-user"), (FIELDS, "user"), (SALT, "user")):
        with pytest.raises(OutputRateConfigError, match=f"{flag} need {FLAG}"):
            start(flag, value)
    # A header that no key may assert, and a gateway key with nothing to
    # assert by.
    with pytest.raises(OutputRateConfigError, match="gateway: true"):
        start(FLAG, "10", KEYS, keys_file(tmp_path, gateway=False), HEADER, "x-u")
    with pytest.raises(OutputRateConfigError, match="neither"):
        start(FLAG, "10", KEYS, keys_file(tmp_path, gateway=True), SALT, "user")
    start(FLAG, "10", KEYS, keys_file(tmp_path, gateway=False), SALT, "user")
    # The HTTP part applies them.
    monkeypatch.setenv("VLLM_PLUGINS", "output_rate")
    with pytest.raises(OutputRateConfigError, match="VLLM_PLUGINS"):
        start(FLAG, "10", HEADER, "x-user")
