"""Run the selected benchmarks, in order, and return everything they measured
as one JSON-able dict (the raw results, ``results.json``): what ran, on what
machine and versions, each benchmark's results or why it did not run, how
busy the rest of the machine was meanwhile, and the servers' start-up times.
The report (``benchmarks.report``) is made from this dict alone.

Order: ``scheduler_cost``, ``engine_modes``, ``store``, ``speculative`` and
``fair_shares`` first (no shared server; ``store`` starts its own
redis-server and engines, ``speculative`` its own servers with speculation
on, ``fair_shares`` its own saturated servers), then the server benchmarks,
which share one pool of servers: each server starts once, before the first
benchmark that needs it, and stops after the last.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import checkout
from benchmarks.accuracy import accuracy
from benchmarks.idle import idle
from benchmarks.isolation import isolation
from benchmarks.metrics_scrape import metrics_scrape_bench
from benchmarks.noise import NoiseMonitor
from benchmarks.progress import log
from benchmarks.servers import ServerPool, common_flags
from benchmarks.throughput import throughput

ORDER = (
    "scheduler_cost",
    "engine_modes",
    "store",
    "speculative",
    "fair_shares",
    "throughput",
    "isolation",
    "idle",
    "accuracy",
    "metrics_scrape",
)

ServerBenchmark = Callable[[ServerPool, bool], dict[str, Any]]
SERVER_BENCHMARKS: dict[str, ServerBenchmark] = {
    "throughput": throughput,
    "isolation": isolation,
    "idle": idle,
    "accuracy": accuracy,
    "metrics_scrape": metrics_scrape_bench,
}
SERVERS_NEEDED: dict[str, set[str]] = {
    "scheduler_cost": set(),
    "engine_modes": set(),
    "store": set(),  # starts its own redis-server and engines
    "speculative": set(),  # starts its own servers (speculation on)
    "fair_shares": set(),  # starts its own servers (few active slots)
    "throughput": {"stock", "ours"},
    "isolation": {"stock", "ours"},
    "idle": {"stock", "ours", "ours-nowait"},
    "accuracy": {"ours"},
    "metrics_scrape": set(),  # starts its own server
}
STARTUP = "server start-up"  # the noise monitor's period while servers start


def _scheduler_cost(quick: bool) -> dict[str, Any]:
    from benchmarks import scheduler_cost

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout
        return scheduler_cost.run(quick=quick)


def _engine_modes(quick: bool, work_dir: Path) -> dict[str, Any]:
    from benchmarks import engine_modes
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    with contextlib.redirect_stdout(sys.stderr):
        return engine_modes.run(
            str(build_tiny_model()), quick=quick, work_dir=work_dir / "engine_modes"
        )


def _store(quick: bool, work_dir: Path) -> dict[str, Any]:
    from benchmarks import store

    with contextlib.redirect_stdout(sys.stderr):
        return store.run(quick=quick, engines=True, work_dir=work_dir / "store")


def _speculative(quick: bool, work_dir: Path) -> dict[str, Any]:
    from benchmarks import speculative

    with contextlib.redirect_stdout(sys.stderr):
        return speculative.run(quick=quick, work_dir=work_dir / "speculative")


def _fair_shares(quick: bool, work_dir: Path) -> dict[str, Any]:
    from benchmarks import fair_shares

    with contextlib.redirect_stdout(sys.stderr):
        return fair_shares.run(quick=quick, work_dir=work_dir / "fair_shares")


def _error(exc: BaseException) -> str:
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"


def _servers(
    names: Sequence[str],
    quick: bool,
    work_dir: Path,
    noise: NoiseMonitor,
    done: dict[str, Any],
    errors: dict[str, str],
) -> ServerPool:
    """Run the server benchmarks ``names`` on one pool (returned, closed)."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    pool = ServerPool(str(build_tiny_model()), work_dir, quick=quick)
    with pool:
        noise.mark(STARTUP)
        try:
            pool.start(*sorted(set().union(*(SERVERS_NEEDED[n] for n in names))))
        except Exception as exc:
            why = f"servers did not start: {_error(exc)}"
            errors.update(dict.fromkeys(names, why))
            return pool
        for k, name in enumerate(names):
            noise.mark(name)
            started = time.monotonic()
            try:
                done[name] = SERVER_BENCHMARKS[name](pool, quick)
            except Exception as exc:
                errors[name] = _error(exc)
            log(f"{name}: {time.monotonic() - started:.0f} s")
            later = set().union(*(SERVERS_NEEDED[n] for n in names[k + 1 :]))
            for server in sorted(SERVERS_NEEDED[name] - later):
                pool.stop(server)
    return pool


def run(
    selected: Sequence[str], quick: bool, work_dir: Path, command: str
) -> dict[str, Any]:
    """Run ``selected`` (names from ORDER) and return the raw results.

    A benchmark that raises is recorded under ``errors`` and the others go
    on; Ctrl-C stops the servers and propagates."""
    root = checkout.repo_root()
    started_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    started = time.monotonic()
    done: dict[str, Any] = {}
    errors: dict[str, str] = {}
    pool: ServerPool | None = None
    noise = NoiseMonitor()
    noise.start()
    try:
        alone: dict[str, Callable[[], dict[str, Any]]] = {
            "scheduler_cost": lambda: _scheduler_cost(quick),
            "engine_modes": lambda: _engine_modes(quick, work_dir),
            "store": lambda: _store(quick, work_dir),
            "speculative": lambda: _speculative(quick, work_dir),
            "fair_shares": lambda: _fair_shares(quick, work_dir),
        }
        for name, measure in alone.items():  # each starts what it needs
            if name not in selected:
                continue
            noise.mark(name)
            t0 = time.monotonic()
            try:
                done[name] = measure()
            except Exception as exc:
                errors[name] = _error(exc)
            log(f"{name}: {time.monotonic() - t0:.0f} s")
        names = [n for n in ORDER if n in selected and n in SERVER_BENCHMARKS]
        if names:
            pool = _servers(names, quick, work_dir, noise, done, errors)
    except KeyboardInterrupt:
        log("interrupted: servers stopped")
        raise
    finally:
        noise.stop()
    return {
        "command": command,
        "quick": quick,
        "benchmarks": [n for n in ORDER if n in selected],
        "started_utc": started_utc,
        "elapsed_s": time.monotonic() - started,
        "machine": checkout.machine(),
        "versions": checkout.versions(root),
        "servers": common_flags(),
        "errors": errors,
        "noise": {n: noise.summary(n) for n in [*ORDER, STARTUP]},
        "server_start_s": pool.start_times_s if pool else {},
        "quiet_gate": pool.gate.summary() if pool else None,
        "results": done,
    }
