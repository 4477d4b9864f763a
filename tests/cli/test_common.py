"""The argument types and the error line every subcommand shares."""

from __future__ import annotations

import argparse

import pytest

from vllm_output_rate.cli.common import fail, positive_float, positive_int


def test_positive_float():
    assert positive_float("0.25") == 0.25
    for bad, message in [
        ("0", "must be > 0"),
        ("-1", "> 0"),
        ("inf", "> 0"),
        ("nan", "> 0"),
        ("x", "not a number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            positive_float(bad)


def test_positive_int():
    assert positive_int("3") == 3
    for bad, message in [
        ("0", "must be >= 1"),
        ("1.5", "not an integer"),
        ("x", "not an integer"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            positive_int(bad)


def test_fail_prints_one_error_line(capsys):
    assert fail("no server", 2) == 2
    assert fail("again") == 1
    assert capsys.readouterr().err.splitlines() == [
        "vllm-output-rate: error: no server",
        "vllm-output-rate: error: again",
    ]
