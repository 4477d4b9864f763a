"""Admission caps from vLLM's own parser, the limits file and the engine's
caps holder: bad input is refused at start-up naming the option, and a
server that could not keep the promise at the door refuses to start."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness.vllm_cli import parse_engine_args, vllm_parser
from vllm_output_rate.admission_caps import Caps, GlobalCaps
from vllm_output_rate.integration.admission_rpc import CapsHolder
from vllm_output_rate.validation import OutputRateConfigError

FLAG = "--default-user-output-tokens-per-second"
DEFAULT_CAP = "--default-user-max-concurrent-requests"
USER_CAPS = "--user-max-concurrent-requests"
DEFAULT_TOKENS = "--default-user-max-queued-prompt-tokens"
USER_TOKENS = "--user-max-queued-prompt-tokens"
HTTP = "output_rate,output_rate_http"


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return vllm_parser()


@pytest.fixture
def http_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", HTTP)


def section(parser, model: str, *argv: str) -> dict:
    config = parse_engine_args(parser, model, *argv)[1]
    return config.additional_config["output_rate"]


def test_flags_parse_and_reach_the_engine_settings(
    parser, tiny_model_path: str, http_plugin: None
) -> None:
    found = section(
        parser,
        tiny_model_path,
        FLAG,
        "100",
        "--max-num-queued-reqs",
        "16",
        DEFAULT_CAP,
        "8",
        USER_CAPS,
        '{"hog": 2}',
        USER_TOKENS,
        '{"hog": 300}',
    )
    assert found["default_user_max_concurrent_requests"] == 8
    assert found["user_max_concurrent_requests"] == {"hog": 2}
    assert found["user_max_queued_prompt_tokens"] == {"hog": 300}
    assert found["default_user_max_queued_prompt_tokens"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([DEFAULT_CAP, "0"], "got 0"),
        ([DEFAULT_CAP, "-2"], "got -2"),
        ([DEFAULT_CAP, "2.5"], "got '2.5'"),
        ([DEFAULT_TOKENS, "many"], "got 'many'"),
        ([USER_CAPS, '{"u": 0}'], "cap of user 'u'"),
        ([USER_CAPS, '{"u": 1.5}'], "got 1.5"),
        ([USER_CAPS, '{"u": true}'], "got True"),
        ([USER_TOKENS, "[3]"], "expected a JSON object"),
        ([USER_TOKENS, '{"": 3}'], "must not be empty"),
    ],
)
def test_bad_caps_name_the_flag_and_value(
    parser, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", FLAG, "10", *argv])
    err = capsys.readouterr().err
    assert message in err and argv[0] in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-num-queued-reqs", "16", DEFAULT_CAP, "17"],
            "--max-num-queued-reqs 16",
        ),
        (["--max-num-queued-reqs", "16", USER_CAPS, '{"u": 40}'], "could never"),
        (["--max-num-queued-tokens", "100", USER_TOKENS, '{"u": 101}'], "tokens 100"),
    ],
)
def test_caps_above_vllms_own_are_refused(
    parser, tiny_model_path: str, http_plugin: None, argv: list[str], message: str
) -> None:
    with pytest.raises(OutputRateConfigError, match=message):
        parse_engine_args(parser, tiny_model_path, FLAG, "10", *argv)


def test_caps_need_limiting_and_the_http_part(
    parser, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(OutputRateConfigError, match=f"need {FLAG}"):
        parse_engine_args(parser, tiny_model_path, DEFAULT_CAP, "4")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(OutputRateConfigError, match="need the HTTP plugin"):
        parse_engine_args(parser, tiny_model_path, FLAG, "10", DEFAULT_CAP, "4")
    # vLLM's own caps would be filled by paused requests without it.
    with pytest.raises(OutputRateConfigError, match="--max-num-queued-reqs with"):
        parse_engine_args(
            parser, tiny_model_path, FLAG, "10", "--max-num-queued-reqs", "8"
        )
    # Stock vLLM (no limiting) keeps its caps as they are.
    config = parse_engine_args(parser, tiny_model_path, "--max-num-queued-reqs", "8")[1]
    assert config.scheduler_config.max_num_queued_reqs == 8


def test_the_limits_file_and_additional_config_merge_under_the_flags(
    parser, tiny_model_path: str, http_plugin: None, tmp_path: Path
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_user_output_tokens_per_second: 50\n"
        "default_user_max_concurrent_requests: 6\n"
        "user_max_concurrent_requests: {a: 1, b: 2}\n"
    )
    extra = {"output_rate": {"user_max_concurrent_requests": {"b": 3, "c": 4}}}
    found = section(
        parser,
        tiny_model_path,
        "--output-rate-config",
        str(limits),
        "--additional-config",
        json.dumps(extra),
        USER_CAPS,
        '{"c": 5}',
    )
    assert found["default_user_max_concurrent_requests"] == 6
    assert found["user_max_concurrent_requests"] == {"a": 1, "b": 3, "c": 5}


def test_a_bad_limits_file_cap_refuses_to_start(
    parser, tiny_model_path: str, http_plugin: None, tmp_path: Path
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_user_output_tokens_per_second: 50\n"
        "user_max_queued_prompt_tokens: {a: -5}\n"
    )
    with pytest.raises(OutputRateConfigError, match=r"limits.yaml.*cap of user 'a'"):
        parse_engine_args(parser, tiny_model_path, "--output-rate-config", str(limits))


def test_the_engine_reloads_the_files_caps_and_keeps_bad_files_out(
    tmp_path: Path,
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text("user_max_concurrent_requests: {a: 1, b: 2}\n")
    now = [0.0]
    holder = CapsHolder(
        Caps(4, {"a": 1, "b": 2, "admin": 3}),
        GlobalCaps(requests=10),
        str(limits),
        clock=lambda: now[0],
    )
    version = holder.version

    def rewrite(text: str) -> None:
        limits.write_text(text)
        stamp = time.time() + now[0]
        os.utime(limits, (stamp, stamp))
        now[0] += 1.5

    default = "default_user_max_concurrent_requests: 5\n"
    rewrite(default + "user_max_concurrent_requests: {a: 2}\n")
    holder.poll_file()
    # b left the file: back to the default; a changed; the admin's user stays.
    assert holder.caps.requests == {"a": 2, "admin": 3}
    assert holder.caps.default_requests == 5
    assert holder.version == version + 1
    rewrite("user_max_concurrent_requests: {a: 11}\n")  # above the global cap
    holder.poll_file()
    assert holder.caps.requests == {"a": 2, "admin": 3}
    rewrite("user_max_concurrent_requests: [not, a, map]\n")
    holder.poll_file()
    assert holder.caps.requests == {"a": 2, "admin": 3}


def test_an_admin_change_is_validated_before_it_applies() -> None:
    holder = CapsHolder(Caps(), GlobalCaps(requests=8))
    caps = holder.update(
        {"user_max_concurrent_requests": {"x": 2}, "remove_users": ["y"]}
    )
    assert holder.caps == Caps()  # not yet applied
    holder.apply(caps)
    assert holder.caps.requests == {"x": 2} and holder.version == 2
    with pytest.raises(OutputRateConfigError, match="request body"):
        holder.update({"default_user_max_concurrent_requests": 9})
