"""Section 4 of the report: isolation (``isolation``'s results): the light
user B alone and beside the heavy user A, per server and round, with a
figure of the medians and one of both users' tokens/s over time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.measure import median
from benchmarks.report import isolation_hog
from benchmarks.report.figures import grouped_bars, pyplot, save
from benchmarks.report.markdown import fmt, image, verdict
from vllm_output_rate.loadtest import LoadResult, LoadSpec
from vllm_output_rate.loadtest.report import plot_rates

TITLE = "4. Isolation"
FIGURE = "isolation.png"
TIMELINE_FIGURE = "isolation_timeline.png"


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) for the report's summary table."""
    f = fmt
    o = results["summary"]["ours"]
    s = results["summary"]["stock"]
    return [
        (
            "4. isolation, B beside A / B alone",
            f"tokens/s >= {results['target']:g}",
            f"{f(o['tok_s_ratio'], 3)} (stock: {f(s['tok_s_ratio'], 3)}); TTFT "
            f"{f(o['ttft_ratio'], 2)} (stock: {f(s['ttft_ratio'], 2)})",
            results["met"],
        ),
        *isolation_hog.summary_rows(results),
    ]


def plot(results: dict[str, Any], path: Path) -> Path:
    """B's tokens/s and TTFT, alone and beside A, per server (medians)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = ("stock", "ours")
    labels = {"stock": "stock vLLM", "ours": "with limits"}
    phases = {
        "alone": "B alone",
        "beside": f"B beside A ({results['a_streams']} streams)",
    }
    for ax, (key, ylabel) in zip(
        axes, (("tok_s", "B tokens/s"), ("ttft_p50_ms", "B TTFT p50 (ms)")), strict=True
    ):
        grouped_bars(
            ax,
            [labels[n] for n in names],
            [
                (
                    label,
                    [
                        median(
                            r[phase][key] for r in results["runs"] if r["server"] == n
                        )
                        or 0.0
                        for n in names
                    ],
                )
                for phase, label in phases.items()
            ],
            width=0.38,
        )
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("Isolation: light user B beside heavy user A")
    return save(fig, path)


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r = results
    lines = [
        "## 4. Isolation: a light user beside a heavy one",
        "",
        f"User B: 1 stream x {r['max_tokens']} tokens (limit {r['b_limit']:g} tok/s "
        f"on ours), {r['duration_s']:g} s, first alone, then beside user A: "
        f"{r['a_streams']} streams x {r['max_tokens']} tokens (limit "
        f"{r['a_limit']:g} tok/s on ours), started {r['lead_s']:g} s before B. "
        "Stock vLLM gets the same load without limits. B's tokens/s is its "
        "first-to-last-token span rate; TTFT is per request, p50. A's rate is "
        "over B's run. On ours A's requests cannot finish at 10 tok/s over 32 "
        "streams; the client cuts them shortly after B's run ends. TTFT is "
        "timed by the client, so it includes the API server's HTTP path, which "
        "on this machine often takes hundreds of ms for a lone stream on either "
        "server; read the TTFT ratio with that in mind. "
        f"{r['rounds']} round(s), servers alternating; ratios are medians "
        "over rounds.",
        "",
        "| server | round | B alone tok/s | B beside A tok/s | ratio | B TTFT p50 "
        "alone ms | beside ms | ratio | A tok/s beside B |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["runs"]:
        al, be = row["alone"], row["beside"]
        lines.append(
            f"| {row['server']} | {row['round'] + 1} | {fmt(al['tok_s'], 0)} "
            f"| {fmt(be['tok_s'], 0)} | {fmt(row['tok_s_ratio'], 3)} "
            f"| {fmt(al['ttft_p50_ms'], 0)} | {fmt(be['ttft_p50_ms'], 0)} "
            f"| {fmt(row['ttft_ratio'], 2)} | {row['a_tok_s_while_b']:,.0f} |"
        )
    s, o = r["summary"]["stock"], r["summary"]["ours"]
    lines += [
        "",
        f"**With limits, B beside A / B alone: {fmt(o['tok_s_ratio'], 3)} "
        f"(tokens/s), {fmt(o['ttft_ratio'], 2)} (TTFT p50)**; target >= "
        f"{r['target']:g} for tokens/s: {verdict(r['met'])}. Stock vLLM: "
        f"{fmt(s['tok_s_ratio'], 3)} (tokens/s), {fmt(s['ttft_ratio'], 2)} "
        f"(TTFT), with A taking {fmt(s['a_tok_s_while_b'], 0)} tok/s "
        f"(ours: {fmt(o['a_tok_s_while_b'], 0)}).",
        "",
    ]
    lines += isolation_hog.section(r)
    lines += image("isolation", plot(r, figures_dir / FIGURE), md_dir)
    timelines = r.get("timelines") or {}
    if "stock" in timelines and "ours" in timelines:
        merged = {
            label: _merge_results(
                LoadResult.from_dict(timelines[name]["A"]),
                LoadResult.from_dict(timelines[name]["B beside A"]),
                r["lead_s"],
            )
            for name, label in (("stock", "stock vLLM"), ("ours", "with limits"))
        }
        timeline = plot_rates(
            merged,
            figures_dir / TIMELINE_FIGURE,
            title=f"User A ({r['a_streams']} streams) and user B (1 stream): "
            "tokens/s over time",
        )
        lines += image("isolation over time", timeline, md_dir)
    return "\n".join(lines)


def _merge_results(a: LoadResult, b: LoadResult, lead_s: float) -> LoadResult:
    """One result with A's and B's users (B's times shifted by the lead)."""
    shifted = []
    for rec in b.records:
        shifted.append(
            replace(
                rec,
                start_s=rec.start_s + lead_s,
                end_s=None if rec.end_s is None else rec.end_s + lead_s,
                first_token_s=None
                if rec.first_token_s is None
                else rec.first_token_s + lead_s,
                chunks=[(t + lead_s, n) for t, n in rec.chunks],
            )
        )
    spec = LoadSpec(
        base_url=a.spec.base_url,
        model=a.spec.model,
        users=[*a.spec.users, *b.spec.users],
        max_tokens=a.spec.max_tokens,
        duration_s=a.spec.duration_s,
    )
    return LoadResult.build(
        spec, [*a.records, *shifted], max(a.elapsed_s, b.elapsed_s + lead_s)
    )
