"""What the report's sections share: numbers, verdicts, figure links and
matplotlib's set-up (headless)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = tuple[str, str, str, bool | None]  # summary: what, target, measured, met


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A number with thousands separators, or '-' for a missing one."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def judged(value: float, bar: float, digits: int = 3) -> str:
    """``value`` to ``digits`` decimals, or more where those would read as
    the ``bar`` it is judged against from the other side of it: 0.9797
    against >= 0.98 shows as 0.9797, not as a missed 0.980."""
    text = f"{value:.{digits}f}"
    while value != bar and float(text) == round(bar, digits) and digits < 6:
        digits += 1
        text = f"{value:.{digits}f}"
    return text


def verdict(met: bool | None) -> str:
    if met is None:
        return "n.a."
    return "met" if met else "**missed**"


def image(alt: str, path: Path, md_dir: Path) -> list[str]:
    """The lines that show a figure written at ``path``."""
    return [f"![{alt}]({Path(os.path.relpath(path, md_dir)).as_posix()})", ""]


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(
    ax: Any, groups: Sequence[str], series: Sequence[tuple[str, Sequence[float]]]
) -> None:
    """One bar per (series, group), the series side by side around each
    group's tick; ``series`` is (legend label, one value per group)."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))


def save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders made) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
