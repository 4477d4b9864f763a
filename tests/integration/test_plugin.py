"""The plugin inside vLLM: entry point, flags, config selection, seams, HTTP checks.

These use vLLM's real parser, EngineArgs and VllmConfig on the tiny model;
no server is started (see tests/e2e for that).
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from collections import deque
from importlib.metadata import entry_points

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

from harness.scheduler_sim import make_scheduler
from harness.vllm_cli import parse_engine_args, vllm_parser
from vllm_output_rate.integration import api_validation, engine_loop, engine_setup
from vllm_output_rate.integration.compat import (
    UnsupportedVllmError,
    check_supported_config,
    check_vllm_version,
)
from vllm_output_rate.integration.engine_setup import ASYNC_SCHEDULER, SYNC_SCHEDULER
from vllm_output_rate.validation import OutputRateConfigError

FLAG = "--default-user-output-tokens-per-second"
USERS = "--user-output-tokens-per-second"


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return vllm_parser()


def engine_config(parser, model: str, *argv: str):
    return parse_engine_args(parser, model, *argv)[1]


def test_the_plugin_is_registered_and_loads() -> None:
    (plugin,) = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.name == "output_rate"
    ]
    register = plugin.load()
    register()  # idempotent: vLLM calls it in every process
    raw = EngineArgs.__dict__["create_engine_config"]
    assert getattr(raw, "__vllm_output_rate_wrapped__", False)


def test_flags_appear_in_help_and_parse(parser) -> None:
    assert FLAG in parser.format_usage()
    args = parser.parse_args(["--model", "m", FLAG, "100", USERS, '{"user-a": 20}'])
    assert args.default_user_output_tokens_per_second == 100
    assert args.user_output_tokens_per_second == {"user-a": 20}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([FLAG, "0"], "got 0.0"),
        ([FLAG, "nan"], "got nan"),
        ([FLAG, "10", USERS, "{not json"], "not valid JSON"),
        ([FLAG, "10", USERS, '{"u": -3}'], "got -3"),
        ([FLAG, "10", USERS, '{"": 3}'], "must not be empty"),
        ([FLAG, "10", USERS, '{"' + "x" * 257 + '": 3}'], "257 characters"),
    ],
)
def test_bad_flag_values_name_the_flag_and_value(
    parser, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", *argv])
    err = capsys.readouterr().err
    assert message in err and ("--default-user" in err or "--user-output" in err)


def test_without_the_flag_vllm_keeps_its_own_scheduler(
    parser, tiny_model_path: str
) -> None:
    config = engine_config(parser, tiny_model_path)
    assert config.scheduler_config.scheduler_cls is None
    assert "output_rate" not in config.additional_config
    from vllm.v1.core.sched.scheduler import Scheduler

    assert config.scheduler_config.get_scheduler_cls() is Scheduler


def test_the_flag_selects_our_scheduler(parser, tiny_model_path: str) -> None:
    config = engine_config(parser, tiny_model_path, FLAG, "50", USERS, '{"a": 5}')
    assert config.scheduler_config.scheduler_cls == SYNC_SCHEDULER
    assert config.additional_config["output_rate"]["user_output_tokens_per_second"] == {
        "a": 5.0
    }


def test_switches_in_additional_config_survive_the_flags(
    parser, tiny_model_path: str
) -> None:
    # The flags rebuild the settings: the switches only additional_config
    # sets must come through (both were dropped once).
    config = engine_config(
        parser,
        tiny_model_path,
        "--additional-config",
        '{"output_rate": {"shortcuts": false, "fair_step_tokens": false}}',
        FLAG,
        "9",
    )
    section = config.additional_config["output_rate"]
    assert section["shortcuts"] is False
    assert section["fair_step_tokens"] is False
    default = engine_config(parser, tiny_model_path, FLAG, "9")
    assert default.additional_config["output_rate"]["fair_step_tokens"] is True


def test_async_scheduling_selects_the_async_variant(
    parser, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(engine_setup.CPU_ASYNC_ENV, "1")
    config = engine_config(parser, tiny_model_path, FLAG, "50")
    assert config.scheduler_config.async_scheduling
    assert config.scheduler_config.scheduler_cls == ASYNC_SCHEDULER


def test_additional_config_and_a_yaml_file_work_without_flags(
    parser, tiny_model_path: str, tmp_path
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(
        "default_user_output_tokens_per_second: 7\n"
        "user_output_tokens_per_second:\n  big: 700\n  small: 0.5\n"
    )
    config = engine_config(
        parser,
        tiny_model_path,
        "--additional-config",
        f'{{"output_rate": {{"config_file": "{limits}"}}}}',
        USERS,
        '{"small": 2}',
        FLAG,
        "9",
    )
    section = config.additional_config["output_rate"]
    assert section["default_user_output_tokens_per_second"] == 9  # flag wins
    assert section["user_output_tokens_per_second"] == {"big": 700, "small": 2}
    assert config.scheduler_config.scheduler_cls == SYNC_SCHEDULER


def test_a_foreign_scheduler_class_is_refused(parser, tiny_model_path: str) -> None:
    with pytest.raises(OutputRateConfigError, match="--scheduler-cls"):
        engine_config(
            parser,
            tiny_model_path,
            FLAG,
            "50",
            "--scheduler-cls",
            "vllm.v1.core.sched.scheduler.Scheduler",
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: setattr(c.parallel_config, "data_parallel_size", 2),
            "data-parallel",
        ),
        (lambda c: setattr(c, "ec_transfer_config", object()), "EC connectors"),
        (
            lambda c: setattr(c.scheduler_config, "prefill_schedule_interval", 4),
            "--prefill-schedule-interval 4",
        ),
    ],
)
def test_unsupported_engine_options_are_refused(
    parser, tiny_model_path: str, change, message: str
) -> None:
    config = engine_config(parser, tiny_model_path)
    check_supported_config(config)  # the tiny Llama itself is fine
    change(config)
    with pytest.raises(OutputRateConfigError, match=message):
        check_supported_config(config)


@pytest.mark.parametrize(
    "argv",
    [
        # n-gram speculative decoding needs no draft model.
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}',
        ],
        ["--enable-lora", "--max-loras", "2"],
        [
            "--kv-transfer-config",
            '{"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}',
        ],
    ],
    ids=["speculative", "lora", "kv-connector"],
)
def test_lifted_engine_modes_are_accepted(
    parser, tiny_model_path: str, argv: list[str]
) -> None:
    config = engine_config(parser, tiny_model_path, FLAG, "50", *argv)
    assert config.scheduler_config.scheduler_cls == SYNC_SCHEDULER


def test_pipeline_parallelism_and_kv_offloading_are_accepted(
    parser, tiny_model_path: str
) -> None:
    config = engine_config(parser, tiny_model_path, FLAG, "50")
    config.parallel_config.pipeline_parallel_size = 2
    config.cache_config.kv_offloading_size = 4.0
    check_supported_config(config)


def test_unsupported_vllm_versions_are_refused() -> None:
    assert check_vllm_version() == __import__("vllm").__version__
    for version in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(UnsupportedVllmError, match=r"supports vLLM.*0\.3[24]"):
            check_vllm_version(version)


def test_http_validation_only_when_limiting_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bad = SamplingParams(extra_args={"output_rate_user": 5})
    monkeypatch.setattr(engine_setup, "limiting_enabled", False)
    api_validation.check_sampling_params(bad)
    api_validation.refuse_beam_search()
    monkeypatch.setattr(engine_setup, "limiting_enabled", True)
    with pytest.raises(VLLMValidationError, match="must be a string"):
        api_validation.check_sampling_params(bad)
    with pytest.raises(VLLMValidationError, match="beam search"):
        api_validation.refuse_beam_search()
    api_validation.check_sampling_params(SamplingParams(extra_args=None))
    api_validation.check_sampling_params(
        SamplingParams(extra_args={"output_rate_user": "alice"})
    )


class _EngineCore:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.input_queue: queue.Queue = queue.Queue()
        self.batch_queue: deque | None = None  # vLLM's, with PP or async


def _throttled_engine(tiny_model_path: str) -> _EngineCore:
    h = make_scheduler(
        tiny_model_path, limits={"default_user_output_tokens_per_second": 2}
    )
    h.add("a", max_tokens=50)
    h.step(0)  # takes the burst (1 token at 2 tok/s)
    h.step(1_000_000)
    # The next token is 500 ms away: the wait is capped at 50 ms.
    assert h.scheduler.output_rate.idle_wait_s() == 0.05
    return _EngineCore(h.scheduler)


def test_idle_engine_waits_until_the_next_token_is_due(tiny_model_path: str) -> None:
    core = _throttled_engine(tiny_model_path)
    started = time.monotonic()
    engine_loop.wait_for_budget(core)
    waited = time.monotonic() - started
    assert 0.02 <= waited <= 0.5  # about the 50 ms cap, not a 1 ms spin


def test_no_idle_wait_while_batches_are_in_flight(tiny_model_path: str) -> None:
    # Pipeline parallelism: other batches' outputs are due; collect them.
    core = _throttled_engine(tiny_model_path)
    core.batch_queue = deque([object()])
    started = time.monotonic()
    engine_loop.wait_for_budget(core)
    assert time.monotonic() - started < 0.01
    core.batch_queue.clear()
    engine_loop.wait_for_budget(core)
    assert time.monotonic() - started >= 0.02


def test_new_input_ends_the_idle_wait_at_once(tiny_model_path: str) -> None:
    core = _throttled_engine(tiny_model_path)
    threading.Timer(0.01, core.input_queue.put, args=(("ADD", None),)).start()
    started = time.monotonic()
    engine_loop.wait_for_budget(core)
    assert time.monotonic() - started < 0.045
    assert core.input_queue.qsize() == 1  # the wait consumed nothing


def test_namespace_without_flags_is_untouched() -> None:
    from vllm_output_rate.integration.cli_flags import settings_from_namespace

    assert settings_from_namespace(argparse.Namespace(additional_config=None)) is None


def test_metrics_label_flags(parser, tiny_model_path: str) -> None:
    config = engine_config(
        parser,
        tiny_model_path,
        FLAG,
        "9",
        "--output-rate-metrics-recent-users",
        "3",
        "--output-rate-metrics-users",
        '["vip"]',
    )
    section = config.additional_config["output_rate"]
    assert section["metrics_recent_users"] == 3
    assert section["metrics_users"] == ["vip"]
    with pytest.raises(SystemExit):  # argparse: a clear error, exit 2
        parser.parse_args(["--output-rate-metrics-recent-users", "lots"])
    with pytest.raises(OutputRateConfigError, match="need --default"):
        engine_config(parser, tiny_model_path, "--output-rate-metrics-users", "[]")


def test_fair_share_flags_reach_the_scheduler_settings(
    parser, tiny_model_path: str
) -> None:
    config = engine_config(
        parser,
        tiny_model_path,
        FLAG,
        "500",
        "--user-output-weight",
        '{"gold": 4}',
        "--user-min-output-tokens-per-second",
        '{"gold": 100}',
        "--output-rate-engine-capacity",
        "2000",
    )
    section = config.additional_config["output_rate"]
    assert section["user_output_weight"] == {"gold": 4.0}
    assert section["user_min_output_tokens_per_second"] == {"gold": 100.0}
    assert section["engine_capacity_tokens_per_second"] == 2000.0


def test_floors_above_the_declared_capacity_refuse_to_start(
    parser, tiny_model_path: str
) -> None:
    from vllm_output_rate.validation import OutputRateConfigError

    with pytest.raises(OutputRateConfigError, match="floors sum to 700 tok/s"):
        engine_config(
            parser,
            tiny_model_path,
            FLAG,
            "500",
            "--user-min-output-tokens-per-second",
            '{"a": 400, "b": 300}',
            "--output-rate-engine-capacity",
            "600",
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--user-output-weight", '{"u": 0}'], "got 0"),
        (["--user-output-weight", '{"u": 2e6}'], "at most 1e+06"),
        (["--user-output-weight", "[1]"], "expected a JSON object"),
        (["--user-min-output-tokens-per-second", '{"u": "x"}'], "got 'x'"),
        (["--output-rate-engine-capacity", "-5"], "got -5"),
    ],
)
def test_bad_fair_share_flags_name_the_flag_and_value(
    parser, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", FLAG, "10", *argv])
    err = capsys.readouterr().err
    assert message in err and argv[0] in err
