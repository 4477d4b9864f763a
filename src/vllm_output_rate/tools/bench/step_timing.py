"""Benchmark-only: time ``schedule()`` inside a running engine core.

The scheduler benchmark (section 2) runs steps back to back, with warm
caches; inside an engine, the engine core waits for the model between steps
and its caches go cold, so the same code costs more there. The engine
throughput benchmark installs this module in its engine processes through a
``sitecustomize`` hook (never the package itself): it wraps vLLM's
``Scheduler.schedule`` (vLLM's own work) and, once the engine core has built
its scheduler, that instance's ``schedule`` (the whole step, ours included),
and writes the running totals to a JSON file every ``WRITE_EVERY`` steps.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

PATH_ENV = "VLLM_OUTPUT_RATE_BENCH_STEP_TIMING"
WRITE_EVERY = 256

# Put on PYTHONPATH as sitecustomize.py: runs at start-up in every process.
HOOK = f'''\
import os

if os.environ.get("{PATH_ENV}"):
    try:
        from vllm_output_rate.tools.bench import step_timing

        step_timing.install(os.environ["{PATH_ENV}"])
    except Exception:  # never break interpreter start-up
        pass
'''


def _timed(function: Callable, add: Callable[[int], None]) -> Callable:
    @functools.wraps(function)  # keeps the plugin's start-up seam checks true
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            add(time.perf_counter_ns() - started)

    return wrapper


def install(path: str) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    totals = {"steps": 0, "schedule_ns": 0, "vllm_schedule_ns": 0}

    def add_vllm(elapsed_ns: int) -> None:
        totals["vllm_schedule_ns"] += elapsed_ns

    def add_step(elapsed_ns: int) -> None:
        totals["schedule_ns"] += elapsed_ns
        totals["steps"] += 1
        if totals["steps"] % WRITE_EVERY == 0:
            with open(path + ".tmp", "w") as out:
                json.dump(totals, out)
            os.replace(path + ".tmp", path)

    Scheduler.schedule = _timed(Scheduler.schedule, add_vllm)
    engine_init = EngineCore.__init__

    @functools.wraps(engine_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        engine_init(self, *args, **kwargs)
        self.scheduler.schedule = _timed(self.scheduler.schedule, add_step)

    EngineCore.__init__ = init


def read(path: str) -> dict[str, float] | None:
    """µs per step: ``schedule`` (the whole call) and ``vllm_schedule``
    (vLLM's own part of it), or None if nothing was written."""
    try:
        with open(path) as source:
            totals = json.load(source)
    except (OSError, ValueError):
        return None
    steps = totals["steps"]
    return {
        "steps": steps,
        "schedule_us": totals["schedule_ns"] / steps / 1e3,
        "vllm_schedule_us": totals["vllm_schedule_ns"] / steps / 1e3,
    }
