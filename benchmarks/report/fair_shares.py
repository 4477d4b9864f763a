"""Section 9 of the report: fair shares on a saturated engine, ours against
stock (``benchmarks.fair_shares``'s results), with a figure of the shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.engine_throughput import SATURATED_KINDS
from benchmarks.fair_shares import (
    ENGINE_ARGS,
    EXPECTED_SHARE,
    FLOORS,
    SCENARIOS,
    WARM_S,
    WEIGHTS,
)
from benchmarks.report.figures import grouped_bars, pyplot, save
from benchmarks.report.markdown import fmt, image, verdict
from benchmarks.report.throughput import engine_time_ratio, step_timing_lines

TITLE = "9. Fair shares on a saturated engine"
SHARE_TOLERANCE = 0.10  # of the expected ratio between the two users
FLOOR_TARGET = 0.9  # of the floor, at the client
THROUGHPUT_TARGET = 0.98  # ours / stock, total tok/s
FIGURE = "fair_shares.png"


def _share_met(scenario: str, row: dict[str, Any]) -> bool | None:
    expected = EXPECTED_SHARE[scenario]
    share = row["ours"]["share"]
    if row["ours"].get("failed"):
        return False
    if expected is None:
        floor = FLOORS[row["user"]]
        return row["ours"]["tok_s"] >= FLOOR_TARGET * floor
    if share is None or share >= 1:
        return False
    want = expected / (1 - expected)
    return abs(share / (1 - share) / want - 1) <= SHARE_TOLERANCE


def _target(scenario: str, user: str) -> str:
    expected = EXPECTED_SHARE[scenario]
    if expected is None:
        return f"{user} >= {FLOOR_TARGET:g} x its floor ({FLOORS[user]:g} tok/s)"
    other = next(u for u in SCENARIOS[scenario] if u != user)
    want = expected / (1 - expected)
    return f"{user} : {other} = {want:g} : 1 within {SHARE_TOLERANCE:.0%}"


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) for the report's summary table."""
    summary = results["servers"]["summary"]
    rows: list[tuple[str, str, str, bool | None]] = []
    for scenario, row in summary.items():
        user = row["user"]
        measured = (
            f"{fmt(row['ours']['tok_s'], 0)} tok/s (stock "
            f"{fmt(row['stock']['tok_s'], 0)})"
            if EXPECTED_SHARE[scenario] is None
            else f"{user} share {fmt(row['ours']['share'], 3)} (stock "
            f"{fmt(row['stock']['share'], 3)})"
        )
        rows.append(
            (
                f"9. fair shares, {scenario}",
                _target(scenario, user),
                measured,
                _share_met(scenario, row),
            )
        )
    engine = results.get("engine")
    if engine:
        q1, q3 = engine["ratio_quartiles"]
        measured = f"{engine['ratio_median']:.3f} [{q1:.2f}-{q3:.2f}]"
        timing = _saturated_timing(engine)
        if timing is not None:
            busy = engine_time_ratio(*timing)
            measured += f"; engine cores' busy time, stock / ours: {busy:.3f}"
        rows.append(
            (
                "9. fair shares: engine throughput, saturated (no HTTP)",
                f"ours / stock >= {THROUGHPUT_TARGET:g}",
                measured,
                engine["ratio_median"] >= THROUGHPUT_TARGET,
            )
        )
    return rows


def _saturated_timing(
    engine: dict[str, Any],
) -> tuple[dict[str, float], dict[str, float]] | None:
    """Stock's and ours' step timing on the saturated load, if recorded."""
    timing = engine.get("step_timing") or {}
    stock, ours = timing.get(SATURATED_KINDS[0]), timing.get(SATURATED_KINDS[1])
    return (stock, ours) if stock and ours else None


def _figure(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    summary = results["servers"]["summary"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    groups = [f"{s}: {row['user']}" for s, row in summary.items()]
    grouped_bars(
        ax,
        groups,
        [
            (server, [row[server]["share"] or 0.0 for row in summary.values()])
            for server in ("stock", "ours")
        ],
        0.35,
    )
    expected = [EXPECTED_SHARE[s] for s in summary]
    for i, want in enumerate(expected):
        if want is not None:
            ax.hlines(want, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_ylabel("share of the engine's tokens")
    ax.set_title("Second user's share on a saturated engine (dashed: weights' share)")
    ax.legend()
    return save(fig, path)


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    streams = "; ".join(
        f"`{s}`: " + ", ".join(f"{u} x {n}" for u, n in users.items())
        for s, users in SCENARIOS.items()
    )
    max_tokens = results["servers"].get("max_tokens", 100)  # older runs: 100
    requests = (
        f"streams send requests of {max_tokens} tokens, ignore_eos, the next "
        "as soon as one ends, and the ones running are cut when the load ends, "
        "so every user stays backlogged"
        if max_tokens > 1000
        else f"streams send {max_tokens}-token requests one after the other, "
        "ignore_eos, so a stream idles on the client between requests"
    )
    about = (
        "Limits far above demand, so the engine itself is the bottleneck: both "
        f"servers run `{' '.join(ENGINE_ARGS)}` at the same time, stock without "
        f"the plugin, ours with weights `{WEIGHTS}` and floors `{FLOORS}` "
        f"(tok/s). Scenarios (user x streams; {requests}): {streams}. Each "
        "load runs on stock then on "
        "ours, in rounds; figures are the client's token counts from "
        f"{WARM_S:g} s after the start to the load's end, and for ours also "
        "the engine's (its dispatch log, the same window), which ours' "
        "verdicts use: vLLM's API server on this 2-core machine can deliver "
        "tokens seconds late, so a share at the client is partly the front "
        "end's; TTFT is each "
        "request's wait for its first token on the full engine, over the "
        "requests that got one (a column says how many did; requests cut "
        "by the load's end are not failures). Stock serves "
        "in queue order; ours by weighted service (docs/architecture.md, "
        '"Fair shares when the engine is full").'
    )
    figure = _figure(results, figures_dir / FIGURE)
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            about,
            "",
            table(results),
            *image("fair shares", figure, md_dir),
        ]
    )


def _engine_time(engine: dict[str, Any]) -> list[str]:
    """Where ours' engine time goes on the saturated load (step timing)."""
    timing = _saturated_timing(engine)
    if timing is None:
        return ["(The engines' step timing was not recorded.)"]
    stock, ours = timing
    ratio = engine_time_ratio(stock, ours)
    extra_steps = ours["steps"] / stock["steps"] - 1
    step_cost = ours["engine_step_us"] / stock["engine_step_us"] - 1
    worker = ""
    if "worker_execute_us" in stock and "worker_execute_us" in ours:
        extra = {
            key: ours[f"worker_{key}_us"] - stock[f"worker_{key}_us"]
            for key in ("execute", "update_states", "forward")
        }
        worker = (
            f" The model worker's side of a step took {extra['execute']:+.0f} µs "
            f"({extra['update_states']:+.0f} µs in the batch's update for the "
            "requests that enter and leave it as turns pass, "
            f"{extra['forward']:+.0f} µs in forward passes of batches of the "
            "same sizes)."
        )
    return [
        *step_timing_lines(stock, ours),
        f"For the same tokens ours ran {extra_steps:+.1%} steps "
        f"{_tail_reason(engine)} of {step_cost:+.1%} cost each. Stock's "
        "engine-core busy time over ours' for the same work "
        "(the throughput ratio of the engine cores alone, summed over every "
        f"step of both engines): **{ratio:.3f}**.{worker}",
    ]


def table(results: dict[str, Any]) -> str:
    srv = results["servers"]
    lines = [
        "| scenario | server | round | user | tok/s | share | TTFT p50 / p95 ms "
        "| requests with a token | total tok/s | failed requests "
        "| engine tok/s | engine share | engine window s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in srv["runs"]:
        for user in SCENARIOS[run["scenario"]]:
            f = run[user]
            engine_run = run.get("engine", {})
            engine = engine_run.get(user, {})
            lines.append(
                f"| {run['scenario']} | {run['server']} | {run['round'] + 1} "
                f"| {user} | {fmt(f['tok_s'], 0)} | {fmt(f['share'], 3)} "
                f"| {fmt(f['ttft_p50_ms'], 0)} / {fmt(f['ttft_p95_ms'], 0)} "
                f"| {f['requests']} | {fmt(run['total_tok_s'], 0)} "
                f"| {run.get('failed', 0)} "
                f"| {fmt(engine.get('tok_s'), 0)} | {fmt(engine.get('share'), 3)} "
                f"| {fmt(engine_run.get('window_s'), 1)} |"
            )
    lines += [
        "",
        "| scenario | target (ours) | ours | stock | verdict "
        "| server total ours / stock |",
        "|---|---|---:|---:|---|---:|",
    ]
    for scenario, row in srv["summary"].items():
        key = "tok_s" if EXPECTED_SHARE[scenario] is None else "share"
        lines.append(
            f"| {scenario} | {_target(scenario, row['user'])} "
            f"| {fmt(row['ours'][key], 3)} | {fmt(row['stock'][key], 3)} "
            f"| {verdict(_share_met(scenario, row))} "
            f"| {fmt(row['throughput_ratio'], 3)} |"
        )
    engine = results.get("engine")
    if engine:
        q1, q3 = engine["ratio_quartiles"]
        lines += [
            "",
            "Total throughput on the engine without HTTP (vLLM's `LLM` class, "
            f"same engine settings and policy; {_round_load(engine)}, "
            f"stock and ours in turn): ours / stock over {engine['rounds']} "
            f"paired rounds, median **{engine['ratio_median']:.3f}** "
            f"(quartiles {q1:.3f}-{q3:.3f}; target >= {THROUGHPUT_TARGET:g}: "
            f"{verdict(engine['ratio_median'] >= THROUGHPUT_TARGET)}). The "
            "servers' totals above (last column of the second table) are "
            "context only.",
            "",
            *_engine_time(engine),
        ]
    changes = results.get("batch_changes")
    if changes:
        lines += ["", _batch_changes(changes)]
    cost = results.get("cost")
    if cost:
        lines += [
            "",
            f"The ranking's step cost (no server; `PYTHONPATH=tests:. python -m "
            f"benchmarks.fair_share_cost --requests {cost['requests']} --rounds "
            f"{cost['rounds']}`): R = {cost['requests']:,} resident requests, "
            "active slots R / 2, so every step is contested: it ranks, or "
            "keeps the last ranking's batch where ranking could not change it "
            "(`kept_batch.py`); stock admits R / 2 in queue order and never "
            "looks at the rest. Plugin calls: the Python and builtin calls "
            "the plugin's code makes in a step (counted in untimed steps).",
            "",
            "| scheduler | schedule() median ms | step / stock (median) "
            "| plugin calls per step |",
            "|---|---:|---:|---:|",
        ]
        for name, row in cost["subjects"].items():
            calls = row.get("plugin_calls_per_step")
            lines.append(
                f"| {name} | {row['schedule_ms']:.2f} "
                f"| {row['step_ratio_to_stock']:.2f} "
                f"| {'-' if calls is None else f'{calls:,.0f}'} |"
            )
    return "\n".join(lines) + "\n"


def _batch_changes(changes: dict[str, Any]) -> str:
    """How often each scheduler's batch changed (runs since 2026-12-03)."""
    stock, ours = changes["stock"], changes["ours"]
    return (
        "How often the batch changes, the model runner's cost above "
        "(scheduler level, vLLM's real scheduler and a fake clock, "
        f"`PYTHONPATH=tests:. python -m benchmarks.batch_changes --steps "
        f"{changes['steps']}`: the engine load, {changes['streams']} streams "
        f"of {changes['max_tokens']} tokens kept busy, for {changes['steps']:,} "
        f"steps): the set of requests scheduled changed {stock['changes']:,} "
        f"times on stock and {ours['changes']:,} on ours, which kept the last "
        f"ranking's batch in {ours['kept_steps']:,} steps; the two users' "
        f"scheduled tokens differed by at most {stock['largest_gap']} on stock "
        f"and {ours['largest_gap']} on ours."
    )


def _round_load(engine: dict[str, Any]) -> str:
    streams, tokens = engine["streams"], engine["max_tokens"]
    if engine.get("continuous"):  # runs since 2026-12-03
        total = engine["generates_per_round"] * streams * tokens
        return (
            f"each round keeps {streams} streams of two users busy with "
            f"requests of {tokens} tokens, each that ends replaced at once, "
            f"for {total:,} tokens (the engine stays saturated to the end; "
            "closed batches of the same requests end in steps with fewer "
            "requests than slots: 2 % of ours' steps, 0 of stock's)"
        )
    return (
        f"each round generates {engine['generates_per_round']} batches of "
        f"{streams} requests of two users, {tokens} tokens each"
    )


def _tail_reason(engine: dict[str, Any]) -> str:
    if engine.get("continuous_warm_up"):
        return "(every step counted, the warm-ups' included, is of an engine kept full)"
    if engine.get("continuous"):
        return (
            "(the engines' warm-up generates, before start and each round, "
            "are closed batches and end in steps with fewer requests than "
            "slots; the timed rounds keep the engine full)"
        )
    return (
        "(the end of each batch, where fewer requests are left than active "
        "slots: stock runs its equal requests in waves that end together, "
        "ours' turns leave the last ones at different points)"
    )
