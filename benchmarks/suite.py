"""The sections of ``make bench``, in the order they run, and the loop that
runs a selection of them.

Every section but the last two starts what it needs itself (engines,
servers, a redis-server); ``isolation`` and ``accuracy`` share one pool of
vLLM servers (``servers``). A section that raises is recorded with its error
and the others go on. Beside each section's results: the seconds it took
and how many cores the rest of the machine used meanwhile (``noise``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import (
    accuracy,
    admission,
    cache_salt,
    checkout,
    fair_shares,
    isolation,
    kv_full,
    prefill,
    scheduler_cost,
    speculative,
    store,
    teams,
)
from benchmarks.engine_throughput import engine_throughput
from benchmarks.measure import log
from benchmarks.noise import NoiseMonitor
from benchmarks.servers import ServerPool, common_flags

THROUGHPUT_PAIRS = ("plain", "prompt", "hybrid")  # kinds.PAIRS judged in "throughput"

Measure = Callable[[bool, Path], dict[str, Any]]


def _throughput(quick: bool, work_dir: Path) -> dict[str, Any]:
    return {
        "pairs": {
            pair: engine_throughput(pair, work_dir / pair, quick)
            for pair in THROUGHPUT_PAIRS
        }
    }


SECTIONS: dict[str, Measure] = {
    "scheduler_cost": lambda quick, _: scheduler_cost.run(quick=quick),
    "throughput": _throughput,
    "store": lambda quick, work_dir: store.run(quick, True, work_dir),
    "speculative": speculative.run,
    "fair_shares": fair_shares.run,
    "kv_full": kv_full.run,
    "admission": admission.run,
    "cache_salt": cache_salt.run,
    "prefill": prefill.run,
    "teams": teams.run,
}
ON_SERVERS: dict[str, Callable[[ServerPool, bool], dict[str, Any]]] = {
    "isolation": isolation.isolation,
    "accuracy": accuracy.accuracy,  # last: it stops ours to read its log
}
ORDER = (*SECTIONS, *ON_SERVERS)


def run_info(command: str, quick: bool) -> dict[str, Any]:
    """What a run's sections have in common: when, what and where."""
    machine = checkout.machine()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": checkout.commit(),
        "command": command,
        "quick": quick,
        "machine": f"{machine['cpu_model']}, {machine['cores']} cores",
        "versions": checkout.versions(),
        "servers": common_flags(),
    }


def run(selected: Sequence[str], quick: bool, work_dir: Path) -> dict[str, Any]:
    """Run ``selected`` (names from ORDER), in ORDER; each name's outcome:
    ``results`` or ``error``, with ``elapsed_s`` and ``noise_cores``."""
    outcomes: dict[str, Any] = {}
    noise = NoiseMonitor()
    noise.start()

    def measure(name: str, body: Callable[[], dict[str, Any]]) -> None:
        noise.mark(name)
        started = time.monotonic()
        try:
            # vLLM logs to stdout; keep it for the command's own output.
            with contextlib.redirect_stdout(sys.stderr):
                outcome: dict[str, Any] = {"results": body()}
        except Exception as exc:
            traceback.print_exc()
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        outcome["elapsed_s"] = time.monotonic() - started
        outcomes[name] = outcome
        log(f"{name}: {outcome['elapsed_s']:.0f} s")

    try:
        for name in (n for n in SECTIONS if n in selected):
            measure(name, functools.partial(SECTIONS[name], quick, work_dir / name))
        on_servers = [n for n in ON_SERVERS if n in selected]
        if on_servers:
            from vllm_output_rate.demo.tiny_model import build_tiny_model

            with ServerPool(
                str(build_tiny_model()), work_dir / "servers", quick
            ) as pool:
                for name in on_servers:
                    measure(name, functools.partial(ON_SERVERS[name], pool, quick))
    finally:
        noise.stop()
    for name, outcome in outcomes.items():
        summary = noise.summary(name)
        outcome["noise_cores"] = summary["others_cores"] if summary else None
    return outcomes
