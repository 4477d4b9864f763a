"""Human-readable output of a load run: a text table and a rate plot.

``format_table(result)`` renders one row per user with ``rich`` (plain text,
no colours, so it can be printed, logged or compared in tests).
``plot_rates(results, path)`` writes a PNG of tokens per second per user over
time; several results become side-by-side panels sharing one y scale (e.g.
``{"stock vLLM": r1, "with limits": r2}`` for the noisy-neighbour picture).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from vllm_output_rate.loadtest.results import LoadResult
from vllm_output_rate.loadtest.summary import UserSummary

__all__ = ["format_table", "plot_rates"]

TABLE_WIDTH = 120


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _limit(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def _bound(u: UserSummary) -> str:
    if u.bound_ok is None:
        return "n.a."
    return "yes" if u.bound_ok else "NO"


def _requests(u: UserSummary) -> str:
    text = str(u.requests_completed)
    if u.requests_failed:
        text += f" (+{u.requests_failed} failed)"
    if u.requests_rejected:
        text += f" (+{u.requests_rejected} x 429"
        if u.retry_after_p50_s is not None:
            text += f", retry {u.retry_after_p50_s:.1f} s"
        text += ")"
    return text


def _tokens(u: UserSummary) -> str:
    text = f"{u.tokens_client:,} / {u.tokens_server:,}"
    if not u.tokens_agree:
        text += f" ({u.token_count_mismatches} req. differ)"
    return text


def format_table(result: LoadResult, title: str | None = None) -> str:
    """A plain-text table, one row per user, plus a totals line.

    Columns: user, limit (tok/s), streams, requests (completed, failed, and
    refused with 429 with their median Retry-After),
    tokens (client count / server usage), measured tok/s over the user's
    first-to-last-token span, TTFT p50/p95 in ms, and whether the bound
    ``tokens <= (W + 0.1) * limit + 1`` held over the window from the user's
    first request sent to its last token (yes / NO / n.a. without a
    limit).
    """
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("user", no_wrap=True)
    table.add_column("limit tok/s", justify="right")
    table.add_column("streams", justify="right")
    table.add_column("requests", justify="right")
    table.add_column("tokens client / server", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("TTFT p50 / p95 ms", justify="right")
    table.add_column("bound held", justify="center")
    for u in result.users:
        table.add_row(
            u.label,
            _limit(u.limit),
            str(u.streams),
            _requests(u),
            _tokens(u),
            _num(u.rate_tok_s),
            f"{_num(u.ttft_p50_ms, 0)} / {_num(u.ttft_p95_ms, 0)}",
            _bound(u),
        )
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=TABLE_WIDTH,
        color_system=None,
        force_terminal=False,
        highlight=False,
        emoji=False,
    )
    console.print(table)
    requests = len(result.records)
    failed = len(result.failed_requests)
    rejected = len(result.rejected_requests)
    refused = f", {rejected} refused with 429" if rejected else ""
    total_rate = result.total_tokens / result.elapsed_s if result.elapsed_s > 0 else 0.0
    totals = (
        f"{result.spec.endpoint} endpoint, max_tokens {result.spec.max_tokens}, "
        f"{result.elapsed_s:.1f} s: {requests} requests ({failed} failed{refused}), "
        f"{result.total_tokens:,} tokens, {total_rate:,.1f} tok/s in total"
    )
    lines = [line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines()]
    return "\n".join([*lines, "", totals])


def _legend_label(u: UserSummary) -> str:
    limit = "no limit" if u.limit is None else f"limit {u.limit:g} tok/s"
    return f"{u.label} ({limit})"


def plot_rates(
    results: Mapping[str, LoadResult] | LoadResult,
    path: str | Path,
    title: str = "Output tokens per second, per user",
) -> Path:
    """Write a PNG of each user's tokens/s (1-second bins) over time.

    ``results`` maps a panel title to a result (a single LoadResult is one
    untitled panel).  Panels sit side by side with the same y scale; a user
    keeps its colour across panels, and its limit, if any, is drawn as a
    dashed line of the same colour.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = {"": results} if isinstance(results, LoadResult) else dict(results)
    if not panels:
        raise ValueError("plot_rates needs at least one result")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    # Scale to the data: a limit far above every measured rate (an
    # "unlimited in practice" user) would flatten every curve to the floor.
    peak = max(
        (v for r in panels.values() for u in r.users for v in u.series_tok_s),
        default=0.0,
    )
    shown_limits = [
        u.limit
        for r in panels.values()
        for u in r.users
        if u.limit is not None and u.limit <= 1.5 * peak
    ]
    y_top = 1.1 * max([peak, *shown_limits]) or 1.0

    fig = Figure(figsize=(6.5 * len(panels), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    colours: dict[str, str] = {}
    palette = [f"C{i}" for i in range(10)]
    for ax, (panel_title, result) in zip(axes, panels.items(), strict=True):
        for u in result.users:
            colour = colours.setdefault(u.label, palette[len(colours) % len(palette)])
            xs = [k * result.bin_s for k in range(len(u.series_tok_s))]
            if xs:
                # One step per bin: repeat the last value to close the last bin.
                ax.step(
                    [*xs, xs[-1] + result.bin_s],
                    [*u.series_tok_s, u.series_tok_s[-1]],
                    where="post",
                    color=colour,
                    label=_legend_label(u),
                )
            else:
                ax.plot([], [], color=colour, label=_legend_label(u))
            if u.limit is not None and u.limit in shown_limits:
                ax.axhline(u.limit, color=colour, linestyle="--", linewidth=1)
        if panel_title:
            ax.set_title(panel_title)
        ax.set_xlabel("time since start (s)")
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[0].set_ylabel(f"output tokens/s ({_bin_text(panels)} bins)")
    axes[0].set_ylim(bottom=0, top=y_top)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path


def _bin_text(panels: Mapping[str, LoadResult]) -> str:
    sizes = {r.bin_s for r in panels.values()}
    return f"{sizes.pop():g} s" if len(sizes) == 1 else "mixed"
