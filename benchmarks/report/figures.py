"""Figure set-up shared by the report's plots (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(
    ax: Any,
    groups: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    width: float,
) -> None:
    """One bar per (series, group), the series side by side around each
    group's tick; ``series`` is (legend label, one value per group)."""
    n = len(series)
    for k, (label, values) in enumerate(series):
        offset = (k - (n - 1) / 2) * width
        ax.bar([i + offset for i in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))


def save(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders made) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
