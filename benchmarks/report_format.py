"""Numbers, verdicts, figure set-up and JSON for the benchmarks' report."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vllm_output_rate.loadtest.summary import percentile


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return float("nan"), float("nan")
    return percentile(xs, 25), percentile(xs, 75)


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def verdict(met: bool | None) -> str:
    if met is None:
        return "n.a."
    return "met" if met else "**missed**"


def relative(path: Path, md_dir: Path) -> str:
    return Path(os.path.relpath(path, md_dir)).as_posix()


def figure_setup() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def jsonable(results: dict[str, Any]) -> dict[str, Any]:
    """Results without private keys (e.g. LoadResult objects for figures)."""
    return {k: v for k, v in results.items() if not k.startswith("_")}
