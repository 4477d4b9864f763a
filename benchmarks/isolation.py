"""4. Isolation: one light user beside a heavy user with many streams, with
and without limits; the light user's tokens/s and TTFT beside the heavy one
divided by the same alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    OthersCpu,
    tokens_between,
    wait_until_drained,
)
from benchmarks.report_format import (
    figure_setup,
    fmt,
    median,
    relative,
    save_figure,
    verdict,
)
from benchmarks.servers import (
    ISO_A,
    ISO_A_LIMIT,
    ISO_A_STREAMS,
    ISO_B,
    ISO_B_LIMIT,
    ServerPool,
    log,
)
from vllm_output_rate.loadtest import (
    LoadResult,
    LoadSpec,
    UserLoad,
    run_load,
    run_load_sync,
)

ISO_TARGET = 0.9
ISO_MAX_TOKENS = 256
ISO_LEAD_S = 3.0


async def _beside(
    url: str, model: str, duration: float, a_limit: float | None, b_limit: float | None
) -> tuple[LoadResult, LoadResult]:
    """A's 32 streams start first; B starts ISO_LEAD_S later and runs
    ``duration``. A's requests are cut by the client (request timeout) about
    two seconds after B's load ends, so a throttled A does not hold the run."""
    a_spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(ISO_A, ISO_A_STREAMS, a_limit)],
        max_tokens=ISO_MAX_TOKENS,
        duration_s=duration + ISO_LEAD_S,
        request_timeout_s=duration + ISO_LEAD_S + 2.0,
    )
    b_spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(ISO_B, 1, b_limit)],
        max_tokens=ISO_MAX_TOKENS,
        duration_s=duration,
    )

    async def b_later() -> LoadResult:
        await asyncio.sleep(ISO_LEAD_S)
        return await run_load(b_spec)

    a, b = await asyncio.gather(run_load(a_spec), b_later())
    return a, b


def _b_summary(result: LoadResult) -> dict[str, Any]:
    u = result.user(ISO_B)
    return {
        "tok_s": u.rate_tok_s,
        "ttft_p50_ms": u.ttft_p50_ms,
        "ttft_p95_ms": u.ttft_p95_ms,
        "tokens": u.tokens_client,
        "requests": u.requests_completed,
        "failed": u.requests_failed,
    }


def isolation(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """User B (1 stream, limit 10000 on ours) alone, then beside user A (32
    streams, limit 10 tok/s on ours, none on stock), on both servers. Per
    server and round: B beside A / B alone, for tokens/s (B's first-to-last
    token span rate) and TTFT p50. Rounds alternate the servers; the figure
    is the median over rounds."""
    rounds = 1 if quick else 3
    duration = 8.0 if quick else 12.0
    model = pool.model
    pool.start("stock", "ours")
    runs = []
    timelines: dict[str, dict[str, LoadResult]] = {}
    for i in range(rounds):
        order = ("stock", "ours") if i % 2 == 0 else ("ours", "stock")
        for name in order:
            url = pool.url(name)
            limited = name == "ours"
            b_limit = ISO_B_LIMIT if limited else None
            a_limit = ISO_A_LIMIT if limited else None
            wait_until_drained(url)
            pool.settle()
            with OthersCpu() as others_alone:
                alone = run_load_sync(
                    LoadSpec(
                        base_url=url,
                        model=model,
                        users=[UserLoad(ISO_B, 1, b_limit)],
                        max_tokens=ISO_MAX_TOKENS,
                        duration_s=duration,
                    )
                )
            wait_until_drained(url)
            pool.settle()
            with OthersCpu() as others_beside:
                a_result, b_result = asyncio.run(
                    _beside(url, model, duration, a_limit, b_limit)
                )
            wait_until_drained(url)
            a_user = a_result.user(ISO_A)
            # A's rate while B ran (client time of A's run: B starts at lead).
            a_window = tokens_between(
                a_result, ISO_A, ISO_LEAD_S, ISO_LEAD_S + duration
            )
            row = {
                "round": i,
                "server": name,
                "alone": _b_summary(alone),
                "beside": _b_summary(b_result),
                "a_tok_s_while_b": a_window / duration,
                "a_tokens": a_user.tokens_client,
                "a_requests_completed": a_user.requests_completed,
                "a_requests_cut": a_user.requests_failed,
                "others_cores_alone": others_alone.cores,
                "others_cores_beside": others_beside.cores,
            }
            al, be = row["alone"], row["beside"]
            row["tok_s_ratio"] = (
                (be["tok_s"] or 0.0) / al["tok_s"] if al["tok_s"] else None
            )
            row["ttft_ratio"] = (
                be["ttft_p50_ms"] / al["ttft_p50_ms"]
                if be["ttft_p50_ms"] is not None and al["ttft_p50_ms"]
                else None
            )
            runs.append(row)
            timelines.setdefault(
                name, {"B alone": alone, "B beside A": b_result, "A": a_result}
            )
            log(
                f"isolation round {i + 1}/{rounds} {name}: B alone "
                f"{fmt(al['tok_s'], 0)} tok/s, beside A {fmt(be['tok_s'], 0)} "
                f"tok/s (ratio {fmt(row['tok_s_ratio'], 3)}); A "
                f"{row['a_tok_s_while_b']:,.0f} tok/s"
            )
    summary = {}
    for name in ("stock", "ours"):
        mine = [r for r in runs if r["server"] == name]
        summary[name] = {
            "tok_s_ratio": median(r["tok_s_ratio"] for r in mine),
            "ttft_ratio": median(r["ttft_ratio"] for r in mine),
            "a_tok_s_while_b": median(r["a_tok_s_while_b"] for r in mine),
        }
    ours_ratio = summary["ours"]["tok_s_ratio"]
    results = {
        "quick": quick,
        "rounds": rounds,
        "duration_s": duration,
        "lead_s": ISO_LEAD_S,
        "max_tokens": ISO_MAX_TOKENS,
        "runs": runs,
        "summary": summary,
        "target": ISO_TARGET,
        "met": ours_ratio is not None and ours_ratio >= ISO_TARGET,
    }
    # Kept out of the JSON (LoadResult is not JSON); used for the figure.
    results["_timelines"] = timelines
    return results


def plot_isolation(results: dict[str, Any], path: Path) -> Path:
    plt = figure_setup()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = ("stock", "ours")
    labels = {"stock": "stock vLLM", "ours": "with limits"}
    for ax, (key, ylabel) in zip(
        axes, (("tok_s", "B tokens/s"), ("ttft_p50_ms", "B TTFT p50 (ms)")), strict=True
    ):
        for k, phase in enumerate(("alone", "beside")):
            values = [
                median(r[phase][key] for r in results["runs"] if r["server"] == n)
                or 0.0
                for n in names
            ]
            ax.bar(
                [i + (k - 0.5) * 0.38 for i in range(len(names))],
                values,
                0.38,
                label="B alone" if phase == "alone" else "B beside A (32 streams)",
            )
        ax.set_xticks(range(len(names)), [labels[n] for n in names])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("Isolation: light user B beside heavy user A")
    return save_figure(fig, path)


def format_isolation(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r = results
    lines = [
        "## 4. Isolation: a light user beside a heavy one",
        "",
        f"User B: 1 stream x {r['max_tokens']} tokens (limit {ISO_B_LIMIT:g} tok/s "
        f"on ours), {r['duration_s']:g} s, first alone, then beside user A: "
        f"{ISO_A_STREAMS} streams x {r['max_tokens']} tokens (limit "
        f"{ISO_A_LIMIT:g} tok/s on ours), started {r['lead_s']:g} s before B. "
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
    path = plot_isolation(r, figures_dir / "isolation.png")
    lines += [f"![isolation]({relative(path, md_dir)})", ""]
    timelines = r.get("_timelines")
    if timelines and "stock" in timelines and "ours" in timelines:
        from vllm_output_rate.loadtest.report import plot_rates

        merged = {}
        for name, label in (("stock", "stock vLLM"), ("ours", "with limits")):
            merged[label] = _merge_results(
                timelines[name]["A"], timelines[name]["B beside A"]
            )
        timeline = plot_rates(
            merged,
            figures_dir / "isolation_timeline.png",
            title="User A (32 streams) and user B (1 stream): tokens/s over time",
        )
        lines += [f"![isolation over time]({relative(timeline, md_dir)})", ""]
    return "\n".join(lines)


def _merge_results(a: LoadResult, b: LoadResult) -> LoadResult:
    """One result with A's and B's users (B's times shifted by the lead)."""
    from dataclasses import replace

    shifted = []
    for rec in b.records:
        shifted.append(
            replace(
                rec,
                start_s=rec.start_s + ISO_LEAD_S,
                end_s=None if rec.end_s is None else rec.end_s + ISO_LEAD_S,
                first_token_s=None
                if rec.first_token_s is None
                else rec.first_token_s + ISO_LEAD_S,
                chunks=[(t + ISO_LEAD_S, n) for t, n in rec.chunks],
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
        spec, [*a.records, *shifted], max(a.elapsed_s, b.elapsed_s + ISO_LEAD_S)
    )
