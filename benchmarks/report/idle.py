"""Section 3 of the report: the idle engine while throttled (``idle``'s
results): CPU of each server process per case, with a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.figures import grouped_bars, pyplot, save
from benchmarks.report.markdown import image, verdict

TITLE = "3. Idle engine while throttled"
FIGURE = "idle.png"


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) for the report's summary table."""
    return [
        (
            "3. idle engine while throttled",
            f"engine core < {results['target_pct']:g} % of one core",
            f"{results['ours_engine_core_pct']:.1f} %",
            results["met"],
        )
    ]


def plot(results: dict[str, Any], path: Path) -> Path:
    """CPU % of each server process, per case, against the target."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = results["rows"]
    roles = [
        ("engine_core", "engine core"),
        ("worker", "model worker"),
        ("api_server", "API server"),
    ]
    grouped_bars(
        ax,
        [r["case"] for r in rows],
        [(label, [r["cpu_pct"].get(role, 0.0) for r in rows]) for role, label in roles],
        width=0.26,
    )
    ax.axhline(
        results["target_pct"],
        color="k",
        linestyle="--",
        linewidth=1,
        label="target (engine core)",
    )
    ax.set_ylabel("CPU, % of one core")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("CPU while only throttled requests are in flight")
    ax.legend(fontsize=8)
    return save(fig, path)


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r = results
    lines = [
        "## 3. Idle engine while throttled",
        "",
        f"User+system CPU time of each server process over a {r['window_s']:g} s "
        f"window (after {r['warmup_s']:g} s of warm-up), as % of one core. The "
        "engine core is the process titled `VLLM::EngineCore` (scheduler and "
        "engine loop); the model runs in `VLLM::Worker`. Stock vLLM cannot "
        "hold requests in flight without progress, so what is compared is: "
        "ours with only throttled requests; the same with the plugin's idle "
        "wait replaced by a no-op (a benchmark-only `sitecustomize` hook on "
        "that server's PYTHONPATH; the package has no such switch), which "
        "leaves vLLM's own loop of schedule, empty model step and `sleep(1 ms)`: "
        "this is what a throttled engine would cost without the wait; stock "
        "vLLM decoding the same 8 streams (busy, for scale); and stock with no "
        "request at all (the floor).",
        "",
        "| case | what runs | tokens in window | engine core % | worker % "
        "| API server % |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        pct = row["cpu_pct"]
        lines.append(
            f"| {row['case']} | {row['description']} | {row['tokens_in_window']} "
            f"| {pct.get('engine_core', 0):.1f} | {pct.get('worker', 0):.1f} "
            f"| {pct.get('api_server', 0):.1f} |"
        )
    nowait = next(x for x in r["rows"] if x["case"] == "ours-nowait")
    ours = next(x for x in r["rows"] if x["case"] == "ours")
    worker_pct = ours["cpu_pct"].get("worker", 0.0)
    lines += [
        "",
        f"**Ours, throttled: engine core at {r['ours_engine_core_pct']:.1f} % of one "
        f"core**; target below {r['target_pct']:g} %: {verdict(r['met'])}. Without "
        f"the idle wait the same state costs "
        f"{nowait['cpu_pct'].get('engine_core', 0):.1f} % (engine core) + "
        f"{nowait['cpu_pct'].get('worker', 0):.1f} % (worker).",
        "",
    ]
    if worker_pct > 20:
        lines += [
            f"The model worker, however, stays busy ({worker_pct:.0f} % of a core) "
            "in the throttled state. It is not computing: vLLM's shared-memory "
            "message queue (`shm_broadcast.SpinCondition`) spins on "
            "`sched_yield()` for 1 s after every message before it blocks, and "
            "the throttled engine sends the worker a message at every wake-up "
            "(the idle wait lasts at most 50 ms, after which an empty step still "
            "calls `execute_model`) and for every due token (1 tok/s here). "
            "Stock vLLM's worker spins the same way whenever it gets a step at "
            "least once a second; with no request at all it blocks (last row). "
            "The target is about the engine core, and it is met; the worker's "
            "spin is reported here so that the figure is not mistaken for the "
            "whole cost.",
            "",
        ]
    lines += image("CPU while throttled", plot(r, figures_dir / FIGURE), md_dir)
    return "\n".join(lines)
