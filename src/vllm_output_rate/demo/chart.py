"""The demo's picture: one figure, one row per scene, stock vLLM vs limits.

Per scene (a row of three panels, grey for stock vLLM, green with limits):

1. the light user's time to first token, p50, on a log scale, at the engine
   and at the client;
2. the light user's rate (tokens per second of request time), at the engine
   and at the client;
3. the other users' rate on a log scale: on stock at the client (stock vLLM
   has no per-user count), with limits at the engine; each limit drawn as a
   red line.

Every bar carries its value, so the figure can be pasted into a slide.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_output_rate.demo.judging import SceneResult

STOCK, LIMITS, LIMIT_LINE = "0.65", "#2a9d55", "#c0392b"
WIDTH = 0.38


def _label(value: float | None, unit: str) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"


def _bars(
    ax: Any,
    groups: Sequence[str],
    stock: Sequence[float | None],
    limits: Sequence[float | None],
    unit: str,
) -> None:
    xs = range(len(groups))
    for offset, values, colour, name in (
        (-WIDTH / 2, stock, STOCK, "stock vLLM"),
        (WIDTH / 2, limits, LIMITS, "with limits"),
    ):
        heights = [v or 0.0 for v in values]
        bars = ax.bar(
            [x + offset for x in xs], heights, WIDTH, color=colour, label=name
        )
        ax.bar_label(bars, [_label(v, unit) for v in values], fontsize="small")
        for x, value in zip(xs, values, strict=True):
            if value is None:  # no bar to label (none at all on a log scale)
                ax.annotate(
                    "n/a",
                    (x + offset, 0.02),
                    xycoords=("data", "axes fraction"),
                    ha="center",
                    fontsize="small",
                )
    ax.set_xticks(list(xs), groups)
    ax.margins(y=0.25)


def _light_panels(ttft_ax: Any, rate_ax: Any, result: SceneResult) -> None:
    light = next(u.name for u in result.scene.users if u.role == "light")
    before, after = result.stock.users[light], result.limited.users[light]
    groups = ["at the engine", "at the client"]
    ms = [
        None if v is None else 1000 * v
        for v in (
            before.ttft_engine_s,
            before.ttft_client_s,
            after.ttft_engine_s,
            after.ttft_client_s,
        )
    ]
    _bars(ttft_ax, groups, ms[:2], ms[2:], " ms")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("ms")
    ttft_ax.set_title("light user: first token, p50 (log)", fontsize="medium")
    if result.scene.light_measure == "answers":
        shares = [
            None if v is None else 100 * v
            for v in (before.outcomes.answered_share, after.outcomes.answered_share)
        ]
        _bars(rate_ax, ["requests answered"], shares[:1], shares[1:], "%")
        rate_ax.set_ylim(0, 110)
        rate_ax.set_ylabel("% of its requests")
        rate_ax.set_title("light user: requests answered", fontsize="medium")
        return
    rate_ax.set_title("light user: tok/s while asking", fontsize="medium")
    _bars(
        rate_ax,
        groups,
        [before.rate_engine, before.rate_client],
        [after.rate_engine, after.rate_client],
        "",
    )
    rate_ax.set_ylim(bottom=0)
    rate_ax.set_ylabel("tok/s")


def _others_panel(ax: Any, result: SceneResult) -> None:
    names = [u.name for u in result.scene.users if u.role != "light"]
    if not names:
        ax.set_axis_off()
        return
    stock = [result.stock.users[n].rate_client for n in names]
    limits = [result.limited.users[n].rate_engine for n in names]
    _bars(ax, names, stock, limits, "")
    ax.set_yscale("log")
    shown = [v for v in (*stock, *limits) if v is not None and v > 0]
    if shown:
        # A decade at least either side: close rates must look close.
        ax.set_ylim(min(shown) / 10, max(shown) * 10)
    throttled = {u.name for u in result.scene.with_role("throttled")}
    for x, name in enumerate(names):
        limit = result.limited.users[name].limit
        if limit is not None and name in throttled:  # a limit that binds
            ax.hlines(limit, x - WIDTH, x + WIDTH, colors=LIMIT_LINE, linestyles="--")
            ax.annotate(
                f"limit {limit:g}",
                (x - WIDTH, limit),
                xytext=(2, -12),
                textcoords="offset points",
                color=LIMIT_LINE,
                fontsize="small",
            )
    ax.set_ylabel("tok/s (stock: client; limits: engine)")


def plot_demo(results: Sequence[SceneResult], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 0.5 + 3.6 * len(results)), layout="constrained")
    FigureCanvasAgg(fig)
    rows = fig.subfigures(len(results), 1, squeeze=False)[:, 0]
    for row, result in zip(rows, results, strict=True):
        ttft_ax, rate_ax, others_ax = row.subplots(1, 3)
        _light_panels(ttft_ax, rate_ax, result)
        _others_panel(others_ax, result)
        flags = " ".join(result.scene.server_args)
        row.suptitle(f"{result.scene.title}   ({flags})", fontweight="bold")
        others = ", ".join(u.name for u in result.scene.users if u.role != "light")
        limits = "limit dashed" if result.scene.with_role("throttled") else "no limit"
        others_ax.set_title(f"{others}: tok/s (log), {limits}", fontsize="medium")
        for ax in (ttft_ax, rate_ax, others_ax):
            ax.grid(True, axis="y", alpha=0.3)
        rate_ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(
        "A light user beside a hog on a scarce engine: stock vLLM vs per-user limits",
        fontsize="x-large",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
