"""Progress lines on stderr while the benchmarks run (``log``), and the one
number formatter (``fmt``) that they and the report share."""

from __future__ import annotations

import math
import sys
import time


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A number with thousands separators, or '-' for a missing one."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"
