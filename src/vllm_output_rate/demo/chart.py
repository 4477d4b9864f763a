"""The demo's picture: the noisy-neighbour effect at a glance.

Three panels sharing the users' colours:

1. each user's delivered tok/s, stock (client view: stock vLLM has no
   per-user count of its own) beside limited (the engine's count), with each
   limit marked;
2. stock vLLM over time, per user (client view, 1-second bins);
3. with limits over time: the engine's rate per user between the plugin's
   stats readings (solid), the client's 1-second bins (dotted), each limit
   dashed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from vllm_output_rate.demo.engine_view import EngineWatch
from vllm_output_rate.loadtest import LoadResult


def plot_demo(
    stock: LoadResult,
    limited: LoadResult,
    engine: EngineWatch,
    engine_start_s: float,
    engine_users: Mapping[str, str],
    path: Path,
) -> Path:
    """``engine_users`` maps each summary label to the engine's user name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 5), layout="constrained")
    FigureCanvasAgg(fig)
    bars, before, after = fig.subplots(
        1, 3, gridspec_kw={"width_ratios": [1, 1.3, 1.3]}
    )
    labels = [u.label for u in limited.users]
    colours = {label: f"C{i}" for i, label in enumerate(labels)}

    # One y scale for all three, fitted to the data: a limit far above every
    # rate (user-b's) is written at the top instead of flattening the rest.
    peak = max(
        [v for r in (stock, limited) for u in r.users for v in u.series_tok_s],
        default=1.0,
    )
    shown = {
        u.label: u.limit
        for u in limited.users
        if u.limit is not None and u.limit <= 1.5 * peak
    }
    top = 1.1 * max([peak, *shown.values()])

    # 1. Delivered tok/s per user, before and after.
    stock_rates = [stock.user(u.name).rate_tok_s or 0.0 for u in limited.users]
    window = (engine_start_s, engine_start_s + limited.spec.duration_s)
    engine_rates = [
        engine.rate(engine_users[u.label], *window) or 0.0 for u in limited.users
    ]
    xs = range(len(labels))
    bars.bar([x - 0.2 for x in xs], stock_rates, 0.4, color="0.75", label="stock vLLM")
    bars.bar(
        [x + 0.2 for x in xs],
        engine_rates,
        0.4,
        color=[colours[label] for label in labels],
        label="with limits (engine)",
    )
    for x, u in zip(xs, limited.users, strict=True):
        if u.label in shown:
            bars.hlines(u.limit, x - 0.05, x + 0.45, colors="black", linewidth=2)
        elif u.limit is not None:
            bars.annotate(
                f"limit {u.limit:g} ↑",
                (x + 0.2, top),
                xytext=(0, -12),
                textcoords="offset points",
                ha="center",
                fontsize="small",
            )
    bars.set_xticks(list(xs), labels, rotation=20)
    bars.set_ylabel("output tok/s per user")
    bars.set_ylim(0, top)
    bars.set_title("Delivered rate (black: the limit)")
    bars.legend(fontsize="small", loc="upper right")

    # 2. and 3. Over time.
    for ax, result, title in (
        (before, stock, "Stock vLLM, per user (client view)"),
        (
            after,
            limited,
            "With limits: engine (solid), client (dotted), limit (--)",
        ),
    ):
        for u in result.users:
            colour = colours[u.label]
            xs_client = [k * result.bin_s for k in range(len(u.series_tok_s))]
            ax.step(
                xs_client,
                u.series_tok_s,
                where="post",
                color=colour,
                linestyle=":" if result is limited else "-",
                linewidth=1 if result is limited else 1.5,
                label=f"{u.label} (client)" if result is limited else u.label,
            )
            if result is limited:
                times, rates = engine.series(engine_users[u.label], engine_start_s)
                ax.step(
                    times,
                    rates,
                    where="post",
                    color=colour,
                    linewidth=2,
                    label=f"{u.label} (engine)",
                )
                if u.label in shown:
                    ax.axhline(u.limit, color=colour, linestyle="--", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("time since the load started (s)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0, top=top)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
    before.set_ylabel("output tok/s (client: 1 s bins)")
    fig.suptitle(
        "Noisy neighbour: the same load on stock vLLM and with per-user limits"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path
