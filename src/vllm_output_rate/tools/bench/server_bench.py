"""Server-level benchmarks: a real vLLM OpenAI server with the plugin against
stock vLLM, side by side in one run, on the same tiny local model and load.

Every figure is a ratio of two measurements taken minutes (or seconds) apart
on the same machine, because the machines this runs on are shared and noisy;
absolute numbers are only context. No test asserts timings.

* ``throughput``: output throughput with limits configured far above demand
  (default 1e6 tok/s) against stock vLLM, alternating rounds, median ratio.
* ``idle``: CPU time of the engine-core process while only throttled
  requests are in flight, against the same plugin with its idle wait switched
  off (vLLM's own 1 ms loop, reproduced by a benchmark-only hook) and against
  stock vLLM decoding the same streams.
* ``isolation``: one light user beside a heavy user with many streams, with
  and without limits; the light user's tokens/s and TTFT beside the heavy one
  divided by the same alone.
* ``accuracy``: measured rate / limit for several limits and stream counts,
  client side and engine side (the scheduler's dispatch log), plus the gap
  between a user's consecutive tokens as the scheduler dispatched them.

Each benchmark is a function ``name(pool, quick) -> dict`` and a Markdown
formatter ``format_name(results, figures_dir, md_dir) -> str``; ``__main__``
runs them and writes BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV
from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log
from vllm_output_rate.tools.loadgen import (
    LoadResult,
    LoadSpec,
    UserLoad,
    build_request_body,
    count_chunk_tokens,
    iter_sse_data,
    percentile,
    run_load,
    run_load_sync,
)
from vllm_output_rate.tools.server import RunningServer, running_server

# ----- configuration shared by every server ----------------------------------

# Same flags for stock and ours; only the limit flags differ.
# --max-model-len 4096 (the tiny model's maximum) lets rate-accuracy
# requests outlast a 20 s run at 100 tok/s.
SERVER_ARGS: list[str] = ["--max-num-seqs", "64", "--max-model-len", "4096"]
START_TIMEOUT_S = 600.0  # a loaded 2-core machine has taken 135 s to start one
DEFAULT_LIMIT = 1e6  # "far above demand": every user not listed below

THROUGHPUT_USER = "tp"  # default limit (1e6 tok/s)
IDLE_USER, IDLE_LIMIT, IDLE_STREAMS = "idle-a", 1.0, 8
ISO_A, ISO_A_LIMIT, ISO_A_STREAMS = "iso-a", 10.0, 32
ISO_B, ISO_B_LIMIT = "iso-b", 10_000.0
ACC_LIMITS: tuple[float, ...] = (5, 20, 100, 500)
ACC_STREAMS: tuple[int, ...] = (1, 4, 16)
QUICK_ACC_STREAMS: tuple[int, ...] = (1, 16)
# Cells run concurrently on one server in batches whose summed limits stay
# at or under this: the tiny model decodes 3,000-6,000 tok/s with 32 streams
# here at best, but only a few hundred when vLLM's CPU processes fall into
# the slow state described in BENCHMARKS.md (which happens often here).
ACC_BATCH_DEMAND = 500.0
ACC_MAX_TOKENS_CAP = 3500  # --max-model-len 4096 minus the prompt, with room

NO_IDLE_WAIT_ENV = "VLLM_OUTPUT_RATE_BENCH_NO_IDLE_WAIT"
# Benchmark-only hook, put on PYTHONPATH of one server: every process of that
# server (the engine core included) imports it at start. It replaces the
# plugin's idle wait by a no-op, which leaves vLLM's own loop: a step that
# runs no model work is followed by time.sleep(0.001) while requests exist.
# The package itself has no switch for this; this is only a counterfactual.
NO_IDLE_WAIT_HOOK = f'''\
import os

if os.environ.get("{NO_IDLE_WAIT_ENV}") == "1":
    try:
        from vllm_output_rate.integration import engine_loop

        engine_loop.wait_for_budget = lambda engine_core: None
    except Exception:  # never break interpreter start-up
        pass
'''


def acc_user(limit: float, streams: int) -> str:
    return f"acc-{limit:g}x{streams}"


def ours_user_limits() -> dict[str, float]:
    """Named limits of the 'ours' servers (everyone else: DEFAULT_LIMIT)."""
    limits = {IDLE_USER: IDLE_LIMIT, ISO_A: ISO_A_LIMIT, ISO_B: ISO_B_LIMIT}
    for limit in ACC_LIMITS:
        for streams in ACC_STREAMS:
            limits[acc_user(limit, streams)] = float(limit)
    return limits


def ours_limit_flags() -> list[str]:
    return [
        "--default-user-output-tokens-per-second",
        f"{DEFAULT_LIMIT:g}",
        "--user-output-tokens-per-second",
        json.dumps(ours_user_limits()),
    ]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----- servers -----------------------------------------------------------------


@dataclass
class ServerConfig:
    name: str
    description: str
    args: list[str]
    env: dict[str, str]


class _ServerThread(threading.Thread):
    """Owns one server for its whole life.

    The server is started from this thread and stopped from it, and the
    thread stays alive in between: ``running_server`` arms PR_SET_PDEATHSIG,
    which fires when the *thread* that forked the server exits.
    """

    def __init__(self, model: str, config: ServerConfig, log_dir: Path) -> None:
        super().__init__(name=f"server-{config.name}", daemon=False)
        self.model = model
        self.config = config
        self.log_dir = log_dir
        self.ready = threading.Event()
        self.stop_event = threading.Event()
        self.url: RunningServer | None = None
        self.error: BaseException | None = None
        self.start_s = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            with running_server(
                self.model,
                self.config.args,
                env=self.config.env,
                start_timeout_s=START_TIMEOUT_S,
                log_dir=self.log_dir,
            ) as url:
                self.start_s = time.monotonic() - started
                self.url = url
                self.ready.set()
                self.stop_event.wait()
        except BaseException as exc:  # reported by the pool
            self.error = exc
        finally:
            self.ready.set()


QUIET_CORES = 0.3  # "quiet": the rest of the machine uses less than this
QUIET_MAX_WAIT_S = 15.0  # per measurement
QUIET_BUDGET_S = {True: 20.0, False: 150.0}  # per run (quick, full)


class QuietGate:
    """Before a measurement, wait until the rest of the machine is quiet
    (other processes below QUIET_CORES cores over a 1 s sample), at most
    QUIET_MAX_WAIT_S each time and ``budget_s`` in all, then go on anyway.
    The samples double as the pause that lets vLLM's worker stop spinning
    after the previous run (it busy-polls for 1 s after each message)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.waits = 0
        self.gave_up = 0
        self.last_cores: float | None = None

    def wait(self) -> float:
        time.sleep(0.5)
        waited = 0.0
        while True:
            with OthersCpu() as others:
                time.sleep(1.0)
            waited += 1.0
            self.last_cores = others.cores
            if others.cores is not None and others.cores < QUIET_CORES:
                break
            if waited >= QUIET_MAX_WAIT_S or self.spent_s + waited >= self.budget_s:
                self.gave_up += 1
                break
        self.waits += 1
        self.spent_s += waited - 1.0  # the first second is the settle pause
        return waited

    def summary(self) -> dict[str, Any]:
        return {
            "threshold_cores": QUIET_CORES,
            "budget_s": self.budget_s,
            "extra_wait_s": self.spent_s,
            "waits": self.waits,
            "gave_up": self.gave_up,
        }


class ServerPool:
    """Named server configurations, started on demand (several at once, in
    parallel, with ``start``) and kept running until ``stop`` or ``close``.

    * ``stock``: no limit flags (the plugin leaves vLLM's scheduler alone);
    * ``ours``: limits (DEFAULT_LIMIT for everyone, named users from
      ``ours_user_limits``) and the scheduler's dispatch log;
    * ``ours-nowait``: the same limits with the plugin's idle wait switched
      off by NO_IDLE_WAIT_HOOK (no dispatch log).
    """

    def __init__(self, model: str, work_dir: Path, quick: bool = False) -> None:
        self.model = model
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.dispatch_log_path = self.work_dir / "dispatch.csv"
        hook_dir = self.work_dir / "no-idle-wait-hook"
        hook_dir.mkdir(exist_ok=True)
        (hook_dir / "sitecustomize.py").write_text(NO_IDLE_WAIT_HOOK)
        python_path = os.pathsep.join(
            p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p
        )
        self.configs: dict[str, ServerConfig] = {
            "stock": ServerConfig(
                "stock", "stock vLLM (no limit flags)", list(SERVER_ARGS), {}
            ),
            "ours": ServerConfig(
                "ours",
                "with limits (default 1e6 tok/s, named users limited), dispatch log",
                [*SERVER_ARGS, *ours_limit_flags()],
                {DISPATCH_LOG_ENV: str(self.dispatch_log_path)},
            ),
            "ours-nowait": ServerConfig(
                "ours-nowait",
                "with limits, idle wait switched off (vLLM's 1 ms loop)",
                [*SERVER_ARGS, *ours_limit_flags()],
                {"PYTHONPATH": python_path, NO_IDLE_WAIT_ENV: "1"},
            ),
        }
        self.gate = QuietGate(QUIET_BUDGET_S[quick])
        self._threads: dict[str, _ServerThread] = {}
        self.start_times_s: dict[str, float] = {}
        self.logs: dict[str, Path] = {}

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, *names: str) -> None:
        """Start the named servers that are not running, in parallel."""
        new = [n for n in names if n not in self._threads]
        for name in new:
            if name == "ours" and self.dispatch_log_path.exists():
                self.dispatch_log_path.unlink()  # the log appends
            log_dir = self.work_dir / f"server-{name}"
            thread = _ServerThread(self.model, self.configs[name], log_dir)
            self._threads[name] = thread
            self.logs[name] = log_dir / "server.log"
            thread.start()
        if new:
            log(f"starting server(s): {', '.join(new)}")
        for name in new:
            thread = self._threads[name]
            thread.ready.wait()
            if thread.error is not None:
                self.stop(name)
                raise RuntimeError(
                    f"server {name!r} did not start: {thread.error}"
                ) from thread.error
            self.start_times_s[name] = thread.start_s
            log(f"server {name} up at {thread.url} after {thread.start_s:.0f} s")

    def settle(self) -> float:
        """Pause before a measurement (see QuietGate); returns seconds."""
        return self.gate.wait()

    def url(self, name: str) -> RunningServer:
        self.start(name)
        url = self._threads[name].url
        assert url is not None
        return url

    def stop(self, name: str) -> None:
        thread = self._threads.pop(name, None)
        if thread is None:
            return
        thread.stop_event.set()
        thread.join()
        log(f"server {name} stopped")

    def close(self) -> None:
        names = list(self._threads)
        for name in names:
            self._threads[name].stop_event.set()
        for name in names:
            self.stop(name)


# ----- process CPU -----------------------------------------------------------


def server_processes(url: RunningServer) -> dict[str, Any]:
    """role -> psutil.Process for a server's process tree.

    Roles: ``api_server`` (the group leader), ``engine_core`` (process title
    ``VLLM::EngineCore``: scheduler and engine loop), ``worker``
    (``VLLM::Worker...``: runs the model), ``other`` (helpers)."""
    import psutil

    leader = psutil.Process(url.process.pid)
    roles: dict[str, Any] = {"api_server": leader}
    for child in leader.children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "EngineCore" in title:
            roles["engine_core"] = child
        elif "Worker" in title:
            roles.setdefault("worker", child)
        else:
            roles.setdefault("other", child)
    if "engine_core" not in roles:
        raise RuntimeError(f"no EngineCore process found under pid {leader.pid}")
    return roles


def cpu_seconds(processes: dict[str, Any]) -> dict[str, float]:
    """role -> user + system CPU seconds so far."""
    out = {}
    for role, proc in processes.items():
        times = proc.cpu_times()
        out[role] = times.user + times.system
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


class OthersCpu:
    """CPU used by everything on the machine except this process and its
    descendants (the servers), over a ``with`` block: ``cores`` afterwards
    is the average number of cores the rest of the machine kept busy."""

    BUSY = ("user", "nice", "system", "irq", "softirq")

    def __enter__(self) -> OthersCpu:
        self._t0 = time.monotonic()
        self._sys0 = self._system()
        self._own0 = self._own()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self._t0
        own = self._own()
        own_delta = sum(v - self._own0.get(pid, 0.0) for pid, v in own.items())
        others = (self._system() - self._sys0) - own_delta
        self.cores = max(0.0, others) / elapsed if elapsed > 0 else None

    def _system(self) -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in self.BUSY)

    @staticmethod
    def _own() -> dict[int, float]:
        import psutil

        me = psutil.Process()
        out = {}
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                out[proc.pid] = times.user + times.system
        return out


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def wait_until_drained(url: str, timeout_s: float = 30.0) -> bool:
    """Wait until the server has no running or waiting request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            busy = _metric(url, "vllm:num_requests_running") + _metric(
                url, "vllm:num_requests_waiting"
            )
            if busy == 0:
                return True
        time.sleep(0.5)
    return False


# ----- small helpers ---------------------------------------------------------


def tokens_between(result: LoadResult, user: str | None, lo: float, hi: float) -> int:
    return sum(
        n
        for r in result.records
        if r.user == user
        for t, n in r.chunks
        if lo <= t <= hi
    )


def rate_until(result: LoadResult, user: str | None, until_s: float) -> float | None:
    """Client-side span rate over the user's tokens up to ``until_s``: the
    tokens after the first chunk, divided by first-to-last chunk time."""
    chunks = sorted(
        (t, n) for r in result.records if r.user == user for t, n in r.chunks
    )
    chunks = [c for c in chunks if c[0] <= until_s]
    if len(chunks) < 2:
        return None
    span = chunks[-1][0] - chunks[0][0]
    if span <= 0:
        return None
    return (sum(n for _, n in chunks) - chunks[0][1]) / span


def _median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return float("nan"), float("nan")
    return percentile(xs, 25), percentile(xs, 75)


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def verdict(met: bool | None) -> str:
    if met is None:
        return "n.a."
    return "met" if met else "**missed**"


def _relative(path: Path, md_dir: Path) -> str:
    return Path(os.path.relpath(path, md_dir)).as_posix()


def _figure_setup() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# =============================================================================
# 1. Throughput when limits do not bind
# =============================================================================

TP_STREAMS = 32
TP_MAX_TOKENS = 256
TP_WARMUP_S = 1.0
TP_TARGET = 0.98


def throughput(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """Stock and ours (every user at 1e6 tok/s) get the same load in
    alternating rounds: 32 concurrent streams x 256 tokens, ignore_eos.

    A round's throughput counts the tokens the client received between
    TP_WARMUP_S and the end of the load (steady state; in-flight requests
    that finish after the deadline are left out). Each round pairs one stock
    and one ours run back to back (the order alternates between rounds); the
    figure is the median over rounds of ours / stock. The server processes'
    CPU seconds per 1,000 tokens (whole process tree) are reported as a
    second, less timing-sensitive view.
    """
    rounds = 3 if quick else 10
    duration = 5.0 if quick else 6.0
    model = pool.model
    pool.start("stock", "ours")
    runs: list[dict[str, Any]] = []
    for i in range(rounds):
        order = ("stock", "ours") if i % 2 == 0 else ("ours", "stock")
        for name in order:
            url = pool.url(name)
            procs = server_processes(url)
            spec = LoadSpec(
                base_url=url,
                model=model,
                users=[UserLoad(THROUGHPUT_USER, TP_STREAMS)],
                max_tokens=TP_MAX_TOKENS,
                duration_s=duration,
            )
            pool.settle()
            before = cpu_seconds(procs)
            with OthersCpu() as others:
                result = run_load_sync(spec)
            cpu = _delta(cpu_seconds(procs), before)
            window = tokens_between(result, THROUGHPUT_USER, TP_WARMUP_S, duration)
            rate = window / (duration - TP_WARMUP_S)
            runs.append(
                {
                    "round": i,
                    "server": name,
                    "tok_s": rate,
                    "tokens_total": result.total_tokens,
                    "elapsed_s": result.elapsed_s,
                    "failed": len(result.failed_requests),
                    "cpu_s": cpu,
                    "cpu_s_per_1k_tokens": 1000
                    * sum(cpu.values())
                    / max(1, result.total_tokens),
                    "ttft_p50_ms": result.users[0].ttft_p50_ms,
                    "others_cores": others.cores,
                }
            )
            log(f"throughput round {i + 1}/{rounds} {name}: {rate:,.0f} tok/s")
    ratios = []
    cpu_ratios = []
    for i in range(rounds):
        s = next(r for r in runs if r["round"] == i and r["server"] == "stock")
        o = next(r for r in runs if r["round"] == i and r["server"] == "ours")
        ratios.append(o["tok_s"] / s["tok_s"] if s["tok_s"] else float("nan"))
        cpu_ratios.append(o["cpu_s_per_1k_tokens"] / s["cpu_s_per_1k_tokens"])
    ratio = _median(ratios)
    quiet = [
        ratios[i]
        for i in range(rounds)
        if all(
            (r["others_cores"] or 0.0) < QUIET_CORES for r in runs if r["round"] == i
        )
    ]
    best = {
        name: max(r["tok_s"] for r in runs if r["server"] == name)
        for name in ("stock", "ours")
    }
    return {
        "quick": quick,
        "rounds": rounds,
        "quiet_ratios": quiet,
        "quiet_ratio_median": _median(quiet) if len(quiet) >= 3 else None,
        "best_tok_s": best,
        "best_ratio": best["ours"] / best["stock"] if best["stock"] else None,
        "duration_s": duration,
        "streams": TP_STREAMS,
        "max_tokens": TP_MAX_TOKENS,
        "runs": runs,
        "ratios": ratios,
        "ratio_median": ratio,
        "cpu_per_token_ratios": cpu_ratios,
        "cpu_per_token_ratio_median": _median(cpu_ratios),
        "target": TP_TARGET,
        "met": ratio is not None and ratio >= TP_TARGET,
        "failed_requests": sum(r["failed"] for r in runs),
    }


def plot_throughput(results: dict[str, Any], path: Path) -> Path:
    plt = _figure_setup()
    fig, ax = plt.subplots(figsize=(7, 4))
    rounds = results["rounds"]
    width = 0.38
    for k, (name, colour) in enumerate((("stock", "C0"), ("ours", "C1"))):
        values = [
            next(
                r["tok_s"]
                for r in results["runs"]
                if r["round"] == i and r["server"] == name
            )
            for i in range(rounds)
        ]
        label = "stock vLLM" if name == "stock" else "with limits (1e6 tok/s)"
        ax.bar(
            [i + (k - 0.5) * width for i in range(rounds)],
            values,
            width,
            label=label,
            color=colour,
        )
    for i, ratio in enumerate(results["ratios"]):
        ax.annotate(
            f"{ratio:.3f}",
            (i, 0),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(range(rounds), [f"round {i + 1}" for i in range(rounds)])
    ax.set_ylabel("output tok/s (32 streams)")
    ax.set_title(
        "Throughput when limits do not bind: median ratio "
        f"{results['ratio_median']:.3f}"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_throughput(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r = results
    lines = [
        "## 1. No cost when limits do not bind",
        "",
        f"Same load on both servers: {r['streams']} concurrent streams x "
        f"{r['max_tokens']} tokens (ignore_eos), {r['duration_s']:g} s per run, "
        f"{r['rounds']} rounds; each round runs stock and ours back to back (order "
        "alternating). Ours has `--default-user-output-tokens-per-second 1e6` "
        "(plus named limits for other benchmarks' users, not used here) and the "
        "engine-side dispatch log on, which is extra work (one line per token) "
        "that makes this comparison conservative. Throughput = tokens received "
        f"between {TP_WARMUP_S:g} s and the end of the load, per second. CPU per "
        "token = user+system CPU seconds of the whole server process tree per "
        "1,000 tokens delivered (vLLM's processes busy-poll each other, so "
        "this rises with wall time too; context only). *Others* = cores the "
        "rest of the machine kept busy during that run (the noise).",
        "",
        "| round | stock tok/s | ours tok/s | ours / stock | CPU s per 1k tok, stock "
        "| ours | ours / stock | others, stock run | others, ours run |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i in range(r["rounds"]):
        s = next(x for x in r["runs"] if x["round"] == i and x["server"] == "stock")
        o = next(x for x in r["runs"] if x["round"] == i and x["server"] == "ours")
        lines.append(
            f"| {i + 1} | {s['tok_s']:,.0f} | {o['tok_s']:,.0f} | {r['ratios'][i]:.3f} "
            f"| {s['cpu_s_per_1k_tokens']:.3f} | {o['cpu_s_per_1k_tokens']:.3f} "
            f"| {r['cpu_per_token_ratios'][i]:.3f} "
            f"| {_fmt(s.get('others_cores'), 2)} | {_fmt(o.get('others_cores'), 2)} |"
        )
    q1, q3 = _quartiles(r["ratios"])
    lines += [
        "",
        f"**Median throughput ratio ours / stock: {r['ratio_median']:.3f}** "
        f"(interquartile range {q1:.3f} to {q3:.3f} over {r['rounds']} rounds); "
        f"target >= {r['target']:.2f}: {verdict(r['met'])}. Over the rounds "
        f"where the rest of the machine stayed below {QUIET_CORES:g} cores in both "
        "runs: "
        + (
            f"median {r['quiet_ratio_median']:.3f} ({len(r['quiet_ratios'])} rounds)"
            if r["quiet_ratio_median"] is not None
            else f"too few rounds ({len(r['quiet_ratios'])})"
        )
        + f". Best run of each server: ours {r['best_tok_s']['ours']:,.0f} / "
        f"stock {r['best_tok_s']['stock']:,.0f} tok/s = {r['best_ratio']:.3f}. "
        f"Median CPU-per-token ratio {r['cpu_per_token_ratio_median']:.3f}. "
        f"Failed requests: {r['failed_requests']}. The scheduler's own cost per "
        "step when no limit binds, free of this noise, is section 2's (a).",
        "",
    ]
    path = plot_throughput(r, figures_dir / "throughput.png")
    lines += [f"![throughput per round]({_relative(path, md_dir)})", ""]
    return "\n".join(lines)


# =============================================================================
# 3. Idle engine while throttled
# =============================================================================

IDLE_TARGET_PCT = 5.0
IDLE_WARMUP_S = 3.0
IDLE_MAX_TOKENS_THROTTLED = 512
IDLE_MAX_TOKENS_BUSY = 256


async def _stream_forever(
    client: httpx.AsyncClient, body: dict[str, Any], arrivals: list[float]
) -> None:
    """Send ``body`` again and again, appending each token's arrival time,
    until cancelled (cancelling closes the connection: vLLM aborts)."""
    while True:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
            async for data in iter_sse_data(response.aiter_lines()):
                if data.strip() == "[DONE]":
                    break
                payload = json.loads(data)
                for choice in payload.get("choices") or []:
                    n = count_chunk_tokens(choice, "completions")
                    arrivals.extend([time.monotonic()] * n)


async def _cpu_with_streams(
    url: RunningServer,
    model: str,
    user: str | None,
    streams: int,
    max_tokens: int,
    warmup_s: float,
    window_s: float,
) -> dict[str, Any]:
    procs = server_processes(url)
    arrivals: list[float] = []
    tasks: list[asyncio.Task] = []
    spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(user, max(1, streams))],
        max_tokens=max_tokens,
        duration_s=window_s,
    )
    body = build_request_body(spec, spec.users[0])
    timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=timeout, limits=limits
    ) as client:
        tasks = [
            asyncio.create_task(_stream_forever(client, body, arrivals))
            for _ in range(streams)
        ]
        try:
            await asyncio.sleep(warmup_s)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise RuntimeError(f"stream failed: {task.exception()}")
            before = cpu_seconds(procs)
            t0 = time.monotonic()
            await asyncio.sleep(window_s)
            after = cpu_seconds(procs)
            t1 = time.monotonic()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = t1 - t0
    cpu = _delta(after, before)
    return {
        "window_s": elapsed,
        "cpu_s": cpu,
        "cpu_pct": {k: 100 * v / elapsed for k, v in cpu.items()},
        "tokens_in_window": sum(1 for t in arrivals if t0 <= t <= t1),
    }


def idle(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """CPU of the engine-core process (and, for context, the model worker and
    the API server) over a window while:

    * ``ours``: only throttled requests are in flight (user limited to 1
      tok/s, 8 streams, max_tokens far beyond what the window allows): the
      plugin's idle wait is on. Target: engine core below 5 % of one core.
    * ``ours-nowait``: the same, with the idle wait replaced by a no-op (a
      benchmark-only hook): what vLLM's own loop (schedule, an empty model
      step, then sleep 1 ms, while requests exist) costs with everything
      throttled.
    * ``stock busy``: stock vLLM decoding the same 8 streams unthrottled
      (requests re-sent as they finish): the engine working, for scale.
    * ``stock empty``: stock vLLM with no request at all (engine blocked on
      its input queue): the floor.
    """
    window = 5.0 if quick else 10.0
    model = pool.model
    pool.start("stock", "ours", "ours-nowait")
    cases = [
        (
            "ours",
            "ours",
            IDLE_USER,
            IDLE_STREAMS,
            IDLE_MAX_TOKENS_THROTTLED,
            "with limits, only throttled requests (user at 1 tok/s, 8 streams); "
            "idle wait on",
        ),
        (
            "ours-nowait",
            "ours-nowait",
            IDLE_USER,
            IDLE_STREAMS,
            IDLE_MAX_TOKENS_THROTTLED,
            "same, idle wait switched off: vLLM's 1 ms loop",
        ),
        (
            "stock busy",
            "stock",
            IDLE_USER,
            IDLE_STREAMS,
            IDLE_MAX_TOKENS_BUSY,
            "stock vLLM decoding the same 8 streams (no limits)",
        ),
        ("stock empty", "stock", None, 0, 0, "stock vLLM with no request in flight"),
    ]
    rows = []
    for key, server, user, streams, max_tokens, description in cases:
        url = pool.url(server)
        wait_until_drained(url)
        pool.settle()
        if streams:
            data = asyncio.run(
                _cpu_with_streams(
                    url, model, user, streams, max_tokens, IDLE_WARMUP_S, window
                )
            )
            drained = wait_until_drained(url)
        else:
            procs = server_processes(url)
            before = cpu_seconds(procs)
            t0 = time.monotonic()
            time.sleep(window)
            cpu = _delta(cpu_seconds(procs), before)
            elapsed = time.monotonic() - t0
            data = {
                "window_s": elapsed,
                "cpu_s": cpu,
                "cpu_pct": {k: 100 * v / elapsed for k, v in cpu.items()},
                "tokens_in_window": 0,
            }
            drained = True
        rows.append(
            {
                "case": key,
                "server": server,
                "description": description,
                "streams": streams,
                "drained_after": drained,
                **data,
            }
        )
        pct = data["cpu_pct"]
        log(
            f"idle {key}: engine core {pct.get('engine_core', 0):.1f} %, worker "
            f"{pct.get('worker', 0):.1f} %, {data['tokens_in_window']} tokens"
        )
    ours = next(r for r in rows if r["case"] == "ours")
    engine_pct = ours["cpu_pct"]["engine_core"]
    return {
        "quick": quick,
        "window_s": window,
        "warmup_s": IDLE_WARMUP_S,
        "rows": rows,
        "target_pct": IDLE_TARGET_PCT,
        "ours_engine_core_pct": engine_pct,
        "met": engine_pct < IDLE_TARGET_PCT,
    }


def plot_idle(results: dict[str, Any], path: Path) -> Path:
    plt = _figure_setup()
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = results["rows"]
    roles = [
        ("engine_core", "engine core"),
        ("worker", "model worker"),
        ("api_server", "API server"),
    ]
    width = 0.26
    for k, (role, label) in enumerate(roles):
        ax.bar(
            [i + (k - 1) * width for i in range(len(rows))],
            [r["cpu_pct"].get(role, 0.0) for r in rows],
            width,
            label=label,
        )
    ax.axhline(
        results["target_pct"],
        color="k",
        linestyle="--",
        linewidth=1,
        label="target (engine core)",
    )
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_ylabel("CPU, % of one core")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("CPU while only throttled requests are in flight")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_idle(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
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
    path = plot_idle(r, figures_dir / "idle.png")
    lines += [f"![CPU while throttled]({_relative(path, md_dir)})", ""]
    return "\n".join(lines)


# =============================================================================
# 4. Isolation
# =============================================================================

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
                f"{_fmt(al['tok_s'], 0)} tok/s, beside A {_fmt(be['tok_s'], 0)} "
                f"tok/s (ratio {_fmt(row['tok_s_ratio'], 3)}); A "
                f"{row['a_tok_s_while_b']:,.0f} tok/s"
            )
    summary = {}
    for name in ("stock", "ours"):
        mine = [r for r in runs if r["server"] == name]
        summary[name] = {
            "tok_s_ratio": _median(r["tok_s_ratio"] for r in mine),
            "ttft_ratio": _median(r["ttft_ratio"] for r in mine),
            "a_tok_s_while_b": _median(r["a_tok_s_while_b"] for r in mine),
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
    plt = _figure_setup()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = ("stock", "ours")
    labels = {"stock": "stock vLLM", "ours": "with limits"}
    for ax, (key, ylabel) in zip(
        axes, (("tok_s", "B tokens/s"), ("ttft_p50_ms", "B TTFT p50 (ms)")), strict=True
    ):
        for k, phase in enumerate(("alone", "beside")):
            values = [
                _median(r[phase][key] for r in results["runs"] if r["server"] == n)
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
            f"| {row['server']} | {row['round'] + 1} | {_fmt(al['tok_s'], 0)} "
            f"| {_fmt(be['tok_s'], 0)} | {_fmt(row['tok_s_ratio'], 3)} "
            f"| {_fmt(al['ttft_p50_ms'], 0)} | {_fmt(be['ttft_p50_ms'], 0)} "
            f"| {_fmt(row['ttft_ratio'], 2)} | {row['a_tok_s_while_b']:,.0f} |"
        )
    s, o = r["summary"]["stock"], r["summary"]["ours"]
    lines += [
        "",
        f"**With limits, B beside A / B alone: {_fmt(o['tok_s_ratio'], 3)} "
        f"(tokens/s), {_fmt(o['ttft_ratio'], 2)} (TTFT p50)**; target >= "
        f"{r['target']:g} for tokens/s: {verdict(r['met'])}. Stock vLLM: "
        f"{_fmt(s['tok_s_ratio'], 3)} (tokens/s), {_fmt(s['ttft_ratio'], 2)} "
        f"(TTFT), with A taking {_fmt(s['a_tok_s_while_b'], 0)} tok/s "
        f"(ours: {_fmt(o['a_tok_s_while_b'], 0)}).",
        "",
    ]
    path = plot_isolation(r, figures_dir / "isolation.png")
    lines += [f"![isolation]({_relative(path, md_dir)})", ""]
    timelines = r.get("_timelines")
    if timelines and "stock" in timelines and "ours" in timelines:
        from vllm_output_rate.tools.report import plot_rates

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
        lines += [f"![isolation over time]({_relative(timeline, md_dir)})", ""]
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


# =============================================================================
# 5. Rate accuracy
# =============================================================================

ACC_TARGET = (1.00, 1.02)
ACC_SKIP_S = 1.0  # engine side: leave out the first second (initial burst)
ACC_CUT_AFTER_S = 0.5
PROBE_USER = "acc-probe"  # 1 stream at the default limit, beside each batch
FLUSH_USER = "acc-flush"
DEMAND_MARGIN = 1.5  # judged if streams x probe rate >= 1.5 x limit


def acc_max_tokens(limit: float, streams: int, duration: float) -> int:
    """More than one stream can get at the limit during the whole run, so
    that each stream's single request is still open at the deadline (the
    client then cuts it): the user's demand never pauses between requests."""
    value = math.ceil(1.2 * limit * duration / streams) + 2
    return int(min(ACC_MAX_TOKENS_CAP, value))


def plan_batches(
    cells: Sequence[tuple[float, int]], cap: float = ACC_BATCH_DEMAND
) -> list[list[tuple[float, int]]]:
    """Pack cells (limit, streams) into batches whose summed limits stay at
    or under ``cap`` (first fit, largest first; a cell above ``cap`` alone)."""
    batches: list[list[tuple[float, int]]] = []
    for cell in sorted(cells, key=lambda c: (-c[0], -c[1])):
        for batch in batches:
            if sum(c[0] for c in batch) + cell[0] <= cap:
                batch.append(cell)
                break
        else:
            batches.append([cell])
    return batches


async def _run_batch(
    url: str, model: str, batch: Sequence[tuple[float, int]], duration: float
) -> tuple[list[LoadResult], LoadResult]:
    specs = [
        LoadSpec(
            base_url=url,
            model=model,
            users=[UserLoad(acc_user(limit, streams), streams, float(limit))],
            max_tokens=acc_max_tokens(limit, streams, duration),
            duration_s=duration,
            # Cut at the deadline: no tail, and no pause in demand.
            request_timeout_s=duration + ACC_CUT_AFTER_S,
        )
        for limit, streams in batch
    ]
    probe = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(PROBE_USER, 1)],
        max_tokens=256,
        duration_s=duration,
    )
    *cells, probe_result = await asyncio.gather(*(run_load(s) for s in [*specs, probe]))
    return list(cells), probe_result


def _engine_stats(
    times_ns: Sequence[int], start_ns: int, duration: float, limit: float
) -> dict[str, Any]:
    """Engine-side rate and gaps from a user's dispatch times, within
    [first dispatch + ACC_SKIP_S, run start + duration]."""
    out: dict[str, Any] = {"dispatched": len(times_ns), "ideal_gap_ms": 1000.0 / limit}
    if not times_ns:
        return out
    lo = times_ns[0] + int(ACC_SKIP_S * 1e9)
    hi = start_ns + int(duration * 1e9)
    window = [t for t in times_ns if lo <= t <= hi]
    out["in_window"] = len(window)
    if len(window) >= 2:
        span_s = (window[-1] - window[0]) / 1e9
        out["rate"] = (len(window) - 1) / span_s if span_s > 0 else None
        gaps_ms = [(b - a) / 1e6 for a, b in itertools.pairwise(window)]
        out["gap_p50_ms"] = percentile(gaps_ms, 50)
        out["gap_p99_ms"] = percentile(gaps_ms, 99)
        out["gap_max_ms"] = max(gaps_ms)
        out["same_step_share"] = sum(1 for g in gaps_ms if g == 0) / len(gaps_ms)
    return out


def _flush_dispatch_log(url: str, model: str) -> None:
    """Push more than FLUSH_EVERY (4,096) tokens through the server so the
    scheduler's dispatch log writes out every line recorded before them:
    the log is written in batches and the engine process may not run its
    exit handlers when the server is stopped."""
    run_load_sync(
        LoadSpec(
            base_url=url,
            model=model,
            users=[UserLoad(FLUSH_USER, 8)],
            max_tokens=600,
            duration_s=0.2,
        )
    )


def accuracy(pool: ServerPool, quick: bool = False) -> dict[str, Any]:
    """Cells (limit, streams) run as distinct users, several at once on the
    'ours' server (batches of summed limits <= ACC_BATCH_DEMAND tok/s), each
    batch beside a probe: one unthrottled stream.

    Per cell: the client-side rate (tokens after the first chunk over the
    first-to-last chunk time, counting chunks up to the load's deadline, so
    that the tail where streams finish one by one does not count), the full
    span rate as loadgen reports it, and the engine-side rate and gaps
    between the user's consecutive dispatched tokens, from the scheduler's
    dispatch log. vLLM gives every running decode one token per step, so the
    probe's rate is what each of a cell's streams could get at that moment:
    a cell's demand exceeds its limit, and the rate target applies, when
    streams x probe rate >= DEMAND_MARGIN x limit.
    """
    duration = 8.0 if quick else 20.0
    streams_set = QUICK_ACC_STREAMS if quick else ACC_STREAMS
    cells = [(limit, s) for limit in ACC_LIMITS for s in streams_set]
    batches = plan_batches(cells)
    model = pool.model
    url = pool.url("ours")
    rows: dict[tuple[float, int], dict[str, Any]] = {}
    probes = []
    for k, batch in enumerate(batches):
        wait_until_drained(url)
        pool.settle()
        start_ns = time.monotonic_ns()
        results, probe = asyncio.run(_run_batch(url, model, batch, duration))
        probe_rate = tokens_between(probe, PROBE_USER, 1.0, duration) / (duration - 1)
        probes.append(probe_rate)
        for (limit, streams), result in zip(batch, results, strict=True):
            name = acc_user(limit, streams)
            u = result.user(name)
            # Requests are cut at the deadline, so the span has no tail.
            client = u.rate_tok_s
            rows[(limit, streams)] = {
                "limit": limit,
                "streams": streams,
                "user": name,
                "batch": k,
                "start_ns": start_ns,
                "max_tokens": result.spec.max_tokens,
                "tokens": u.tokens_client,
                "requests_cut_or_failed": u.requests_failed,
                "client_rate": client,
                "client_rate_to_deadline": rate_until(result, name, duration),
                "client_ratio": client / limit if client else None,
                "bound_ok": u.bound_ok,
                "probe_tok_s": probe_rate,
                "demand_exceeds_limit": streams * probe_rate >= DEMAND_MARGIN * limit,
            }
        log(
            f"accuracy batch {k + 1}/{len(batches)} (probe {probe_rate:,.0f} tok/s) "
            + ", ".join(
                f"{acc_user(*c)}={_fmt(rows[c]['client_ratio'], 3)}" for c in batch
            )
        )
    _flush_dispatch_log(url, model)
    pool.stop("ours")
    engine_ok = pool.dispatch_log_path.exists()
    dispatch = read_dispatch_log(str(pool.dispatch_log_path)) if engine_ok else {}
    for row in rows.values():
        stats = _engine_stats(
            dispatch.get(row["user"], []), row["start_ns"], duration, row["limit"]
        )
        row["engine"] = stats
        row["engine_complete"] = stats["dispatched"] >= row["tokens"]
        rate = stats.get("rate")
        row["engine_ratio"] = rate / row["limit"] if rate else None
        if row["demand_exceeds_limit"] and row["client_ratio"] is not None:
            # Rounded to the target's precision (two decimals).
            row["met"] = ACC_TARGET[0] <= round(row["client_ratio"], 2) <= ACC_TARGET[1]
        else:
            row["met"] = None
    ordered = [rows[c] for c in cells]
    judged = [r for r in ordered if r["met"] is not None]
    return {
        "quick": quick,
        "duration_s": duration,
        "batches": [[acc_user(*c) for c in b] for b in batches],
        "batch_demand_cap": ACC_BATCH_DEMAND,
        "probe_tok_s": probes,
        "rows": ordered,
        "target": list(ACC_TARGET),
        "met": bool(judged) and all(r["met"] for r in judged),
        "dispatch_log_read": engine_ok,
        "engine_complete": all(r["engine_complete"] for r in ordered),
    }


def plot_accuracy(results: dict[str, Any], path: Path) -> Path:
    plt = _figure_setup()
    rows = results["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['limit']:g}x{r['streams']}" for r in rows]
    xs = range(len(rows))
    ax = axes[0]
    ax.bar(
        [x - 0.2 for x in xs],
        [r["client_ratio"] or 0 for r in rows],
        0.4,
        label="client",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["engine_ratio"] or 0 for r in rows],
        0.4,
        label="engine",
    )
    ax.axhspan(*results["target"], color="g", alpha=0.15, label="target 1.00-1.02")
    for x, r in zip(xs, rows, strict=True):
        if not r["demand_exceeds_limit"]:
            ax.annotate("demand\n< limit", (x, 0.05), ha="center", fontsize=6)
    ax.set_xticks(list(xs), labels, rotation=45, fontsize=8)
    ax.set_xlabel("limit tok/s x streams")
    ax.set_ylabel("measured rate / limit")
    ax.set_ylim(0, 1.2)
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[1]
    ax.plot(
        list(xs),
        [r["engine"].get("ideal_gap_ms") for r in rows],
        "k_",
        markersize=14,
        label="1 / limit",
    )
    ax.plot(list(xs), [r["engine"].get("gap_p50_ms") for r in rows], "o", label="p50")
    ax.plot(list(xs), [r["engine"].get("gap_p99_ms") for r in rows], "^", label="p99")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xticks(list(xs), labels, rotation=45, fontsize=8)
    ax.set_xlabel("limit tok/s x streams")
    ax.set_ylabel("engine-side gap between a user's tokens (ms)")
    ax.legend(fontsize=8)
    fig.suptitle("Rate accuracy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_accuracy(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    r = results
    probes = ", ".join(f"{p:,.0f}" for p in r["probe_tok_s"])
    lines = [
        "## 5. Rate accuracy",
        "",
        "Each cell is one user with that limit and that many concurrent streams, "
        f"{r['duration_s']:g} s of load. Each stream sends one request with "
        "max_tokens about 1.2 x limit x duration / streams (at most "
        f"{ACC_MAX_TOKENS_CAP}; servers run with `--max-model-len 4096`), so "
        "that it is still open at the deadline, where the client cuts it: the "
        "user's demand never pauses. (With requests that end during the run, "
        "a user's streams, which take turns, end together, and the user asks "
        "for nothing until the client's next requests reach the engine; on "
        "this machine that takes long enough, hundreds of ms, to cost one-"
        "stream and 100 tok/s users 1-10 % of their rate, which measures the "
        "HTTP path, not the limiter.) "
        "Cells run concurrently on the limited server, in batches whose limits "
        f"sum to at most {r['batch_demand_cap']:g} tok/s, each beside a probe "
        "(one stream, no binding limit): "
        + "; ".join("[" + ", ".join(b) + "]" for b in r["batches"])
        + f". Probe rate per batch: {probes} tok/s. vLLM gives every running "
        "decode one token per step, so the probe's rate is what each stream of "
        "a cell could have had: a cell's demand exceeds its limit, and the "
        f"target applies, when streams x probe rate >= {DEMAND_MARGIN:g} x limit. "
        "**client** = the client span rate, loadgen's figure: (tokens - 1) / "
        "time from the user's first to its last token over all its streams "
        "(requests are cut at the deadline, so there is no tail); "
        "**engine** = the scheduler's own count from its dispatch log, from "
        f"the first dispatch + {ACC_SKIP_S:g} s (after the 100 ms burst) to the "
        "deadline: the exact rate, free of HTTP delivery timing. Gaps are "
        "between a user's consecutive dispatched tokens "
        "(engine clock; tokens dispatched in the same step have gap 0). The "
        "verdict uses the client rate rounded to two decimals, the target's "
        "precision.",
        "",
        "| limit | streams | max_tokens | tokens | client / limit "
        "| engine / limit | gap p50 ms | gap p99 ms | 1/limit ms | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        e = row["engine"]
        if row["met"] is None:
            target = (
                "n.a. (demand < limit)" if not row["demand_exceeds_limit"] else "n.a."
            )
        else:
            target = verdict(row["met"])
        lines.append(
            f"| {row['limit']:g} | {row['streams']} | {row['max_tokens']} "
            f"| {row['tokens']:,} | {_fmt(row['client_ratio'], 3)} "
            f"| {_fmt(row['engine_ratio'], 3)} "
            f"| {_fmt(e.get('gap_p50_ms'), 1)} | {_fmt(e.get('gap_p99_ms'), 1)} "
            f"| {_fmt(e.get('ideal_gap_ms'), 1)} | {target} |"
        )
    judged = [x for x in r["rows"] if x["met"] is not None]
    missed = [f"{x['limit']:g}x{x['streams']}" for x in judged if not x["met"]]
    engine = [x["engine_ratio"] for x in judged if x["engine_ratio"] is not None]
    lines += [
        "",
        f"**Target client rate / limit in [{r['target'][0]:.2f}, "
        f"{r['target'][1]:.2f}] where demand exceeds the limit: "
        f"{verdict(r['met'])}** ({len(judged) - len(missed)} of {len(judged)} "
        "cells"
        + (f"; missed: {', '.join(missed)}" if missed else "")
        + ")."
        + (
            f" Engine-side rate / limit over the same cells: {min(engine):.3f} "
            f"to {max(engine):.3f}."
            if engine
            else ""
        ),
        "",
    ]
    if not r["dispatch_log_read"] or not r.get("engine_complete", True):
        lines += [
            "(The dispatch log was missing or incomplete for some cells: their "
            "engine-side figures are partial.)",
            "",
        ]
    path = plot_accuracy(r, figures_dir / "accuracy.png")
    lines += [f"![rate accuracy]({_relative(path, md_dir)})", ""]
    return "\n".join(lines)


# ----- registry ----------------------------------------------------------------

BenchFn = Callable[[ServerPool, bool], dict[str, Any]]
FormatFn = Callable[[dict[str, Any], Path, Path], str]

SERVER_BENCHMARKS: dict[str, tuple[BenchFn, FormatFn]] = {
    "throughput": (throughput, format_throughput),
    "isolation": (isolation, format_isolation),
    "idle": (idle, format_idle),
    "accuracy": (accuracy, format_accuracy),
}


def jsonable(results: dict[str, Any]) -> dict[str, Any]:
    """Results without private keys (e.g. LoadResult objects for figures)."""
    return {k: v for k, v in results.items() if not k.startswith("_")}
