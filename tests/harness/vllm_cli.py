"""vLLM's own command-line parser with the plugin's flags, for the tests."""

from __future__ import annotations

import argparse
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_output_rate.config import OutputRateSettings

try:  # vLLM 0.33 moved it
    from vllm.entrypoints.common.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser


def vllm_parser() -> FlexibleArgumentParser:
    """``vllm serve``'s parser, after the plugins added their flags."""
    load_general_plugins()
    return make_arg_parser(FlexibleArgumentParser())


def parse_engine_args(
    parser: FlexibleArgumentParser, model: str, *argv: str
) -> tuple[argparse.Namespace, Any]:
    """The parsed arguments and the engine configuration they make."""
    args = parser.parse_args(["--model", model, *argv])
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


def engine_settings(
    parser: FlexibleArgumentParser, model: str, *argv: str
) -> OutputRateSettings:
    """The plugin's settings as the engine reads them from its configuration
    (limiting must be on)."""
    _, config = parse_engine_args(parser, model, *argv)
    settings = OutputRateSettings.from_additional_config(config.additional_config)
    assert settings is not None
    return settings
