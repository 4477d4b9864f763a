"""What the subcommands share: the program name, the error line, number types."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import TypeVar

PROG = "vllm-output-rate"
N = TypeVar("N", int, float)


def fail(message: str, code: int = 1) -> int:
    """Print ``vllm-output-rate: error: MESSAGE`` on stderr; return ``code``."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _positive(text, float, "a number", "> 0")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _positive(text, int, "an integer", ">= 1")


def _positive(text: str, kind: Callable[[str], N], what: str, bound: str) -> N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be {bound}: {text!r}")
    return value
