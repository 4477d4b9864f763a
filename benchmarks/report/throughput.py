"""Engine throughput when limits do not bind: each pair's paired rounds
(``engine_throughput``'s results), with their step timing and a figure of
every round's ratio. Also the pieces that other sections' engine pairs use
(``engine_lines``, ``step_timing_lines``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, image, judged, pyplot, save, verdict

TITLE = "Engine throughput when limits do not bind"
TARGET = 0.98
FIGURE = "throughput.png"
ABOUT = (
    "vLLM's offline `LLM` class: the same engine-core and model-worker "
    "processes, scheduler, KV cache manager and model as the OpenAI server, "
    "without the HTTP front end, whose throughput for one and the same load "
    "swings up to tenfold between runs on this 2-core machine (stock and "
    "ours alike; the cause, somewhere in vLLM's front end here, was not "
    'found). Stock runs without the plugin loaded (`VLLM_PLUGINS=""`); ours '
    "with every user's limit far above demand (1e6 tok/s; in the prompt pair "
    "its prompt-token rate too, so the step counts each user's prompt work "
    "but nothing binds). Each engine lives "
    "in its own process; each round runs both, order alternating, after "
    "both went idle, each run after one untimed generation; the figure is "
    "the median over rounds of ours / stock in the same round."
)


def _ratio(engine: dict[str, Any], target: float = TARGET) -> str:
    q1, q3 = engine["ratio_quartiles"]
    return f"{judged(engine['ratio_median'], target)} [{q1:.2f}-{q3:.2f}]"


def summary_rows(results: dict[str, Any]) -> list[Row]:
    return [
        (
            f"engine throughput, {pair}",
            f"ours / stock >= {TARGET:g}",
            _ratio(engine),
            engine["ratio_median"] >= TARGET,
        )
        for pair, engine in results["pairs"].items()
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    pairs = results["pairs"]
    return {
        f"{pair}_engine": pairs[pair]["ratio_median"] if pair in pairs else None
        for pair in ("plain", "prompt", "hybrid")
    }


def engine_lines(engine: dict[str, Any], target: float = TARGET) -> list[str]:
    """One pair's load, ratio and verdict, and its step timing."""
    labels, tokens = engine["labels"], engine["tokens_per_round"]
    load = (
        f"{engine['streams']} streams kept busy with requests of "
        f"{engine['max_tokens']} tokens, {tokens:,} tokens a round"
        if engine["continuous"]
        else f"{engine['streams']} requests x {engine['max_tokens']} tokens, "
        f"{tokens:,} tokens a round"
    )
    ratios = engine["ratios"]
    return [
        f"**{engine['pair']}** ({engine['description']}; {load}): "
        f"{labels['candidate']} / {labels['baseline']} **{_ratio(engine, target)}** "
        f"(median [quartiles] of {engine['rounds']} paired rounds; single "
        f"rounds {min(ratios):.2f}-{max(ratios):.2f}); target >= {target:g}: "
        f"{verdict(engine['ratio_median'] >= target)}.",
        "",
        *step_timing_lines(engine),
    ]


def _whose(label: str) -> str:
    return label + ("'" if label.endswith("s") else "'s")


def step_timing_lines(engine: dict[str, Any]) -> list[str]:
    """Inside both engine cores (``step_timing``), µs per step."""
    timing = engine.get("step_timing") or {}
    base, cand = timing.get("baseline"), timing.get("candidate")
    if not base or not cand:
        return ["(The engines' step timing was not recorded.)", ""]
    labels = engine["labels"]
    rows = [
        ("steps", "steps", "{:,}"),
        ("`schedule()`", "schedule_us", "{:.1f}"),
        ("of which vLLM's own `Scheduler.schedule`", "vllm_schedule_us", "{:.1f}"),
        (
            "`get_grammar_bitmask()` (ours settles the step there)",
            "bitmask_us",
            "{:.1f}",
        ),
        ("`update_from_output()`", "update_us", "{:.1f}"),
        ("whole engine-core step, the model included", "engine_step_us", "{:.1f}"),
    ]
    added = cand["schedule_us"] - base["schedule_us"]
    busy = (base["steps"] * base["engine_step_us"]) / (
        cand["steps"] * cand["engine_step_us"]
    )
    return [
        f"| µs per step | {labels['baseline']} | {labels['candidate']} |",
        "|---|---:|---:|",
        *(
            f"| {name} | {fmt.format(base[key])} | {fmt.format(cand[key])} |"
            for name, key, fmt in rows
            if key in base and key in cand
        ),
        "",
        f"{_whose(labels['candidate'])} `schedule()`, what the engine waits for "
        f"before the model runs, takes {added:+.1f} µs a step against "
        f"{_whose(labels['baseline'])}, {added / base['engine_step_us']:+.1%} of "
        f"{_whose(labels['baseline'])} engine step; the engine cores' busy time "
        f"for the same work, {labels['baseline']} / {labels['candidate']}: "
        f"{busy:.3f}.",
        "",
    ]


def _plot(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for pair, engine in results["pairs"].items():
        ax.plot(range(1, engine["rounds"] + 1), engine["ratios"], "o-", label=pair)
    ax.axhline(1.0, color="k", linewidth=1)
    ax.axhline(TARGET, color="r", linestyle=":", linewidth=1)
    ax.set_xlabel("round")
    ax.set_ylabel("ours / stock tok/s")
    ax.set_title("Engine throughput, limits far above demand: every round")
    ax.legend()
    return save(fig, path)


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [ABOUT, ""]
    for engine in results["pairs"].values():
        lines += engine_lines(engine)
    lines += image(
        "ours / stock per round", _plot(results, figures_dir / FIGURE), md_dir
    )
    return "\n".join(lines)
