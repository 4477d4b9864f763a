"""Benchmark-only: time ``schedule()`` inside a running engine core.

The scheduler step benchmark runs steps back to back, with warm
caches; inside an engine, the engine core waits for the model between steps
and its caches go cold, so the same code costs more there. The engine
throughput benchmark installs this module in its engine processes through a
``sitecustomize`` hook (``benchmarks.hooks``): it wraps vLLM's
``Scheduler.schedule`` (vLLM's own work) and, once the engine core has built
its scheduler, that instance's ``schedule`` (the whole call, ours included),
``get_grammar_bitmask`` (where ours settles the step, while the worker runs
it), ``update_from_output`` and the engine core's whole step, and writes the
running totals to a JSON file every ``WRITE_EVERY`` steps and when the
scheduler shuts down.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks.hooks import hook_source

PATH_ENV = "VLLM_OUTPUT_RATE_BENCH_STEP_TIMING"
WRITE_EVERY = 256

HOOK_NAME = "step-timing"
# Put on PYTHONPATH as sitecustomize.py (benchmarks.hooks): runs at start-up
# in every process of an engine that has PATH_ENV set.
HOOK = hook_source(
    HOOK_NAME,
    PATH_ENV,
    f"""
    from benchmarks import step_timing

    step_timing.install(os.environ["{PATH_ENV}"])
    """,
)


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

    totals = {
        "steps": 0,
        "schedule_ns": 0,
        "vllm_schedule_ns": 0,
        "update_ns": 0,
        "bitmask_ns": 0,
        "engine_steps": 0,
        "engine_step_ns": 0,
    }

    def adder(key: str) -> Callable[[int], None]:
        def add(elapsed_ns: int) -> None:
            totals[key] += elapsed_ns

        return add

    def add_engine_step(elapsed_ns: int) -> None:
        totals["engine_step_ns"] += elapsed_ns
        totals["engine_steps"] += 1

    def write() -> None:
        with open(path + ".tmp", "w") as out:
            json.dump(totals, out)
        os.replace(path + ".tmp", path)

    def add_schedule(elapsed_ns: int) -> None:
        totals["schedule_ns"] += elapsed_ns
        totals["steps"] += 1
        if totals["steps"] % WRITE_EVERY == 0:
            write()

    Scheduler.schedule = _timed(Scheduler.schedule, adder("vllm_schedule_ns"))
    engine_init = EngineCore.__init__

    @functools.wraps(engine_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        engine_init(self, *args, **kwargs)
        scheduler = self.scheduler
        scheduler.schedule = _timed(scheduler.schedule, add_schedule)
        scheduler.update_from_output = _timed(
            scheduler.update_from_output, adder("update_ns")
        )
        scheduler.get_grammar_bitmask = _timed(
            scheduler.get_grammar_bitmask, adder("bitmask_ns")
        )
        # The whole engine-core step: schedule, the model (run by the
        # worker process, waited for here) and update_from_output.
        self.step_fn = _timed(self.step_fn, add_engine_step)
        # The last steps too (step counts are compared between engines).
        shutdown = scheduler.shutdown

        @functools.wraps(shutdown)
        def shutdown_and_write() -> None:
            write()
            shutdown()

        scheduler.shutdown = shutdown_and_write

    EngineCore.__init__ = init


def read(path: str) -> dict[str, float] | None:
    """µs per step: ``schedule`` (the whole call), ``vllm_schedule`` (vLLM's
    own part of it), ``update`` (update_from_output), ``bitmask``
    (get_grammar_bitmask: ours settles the step there) and ``engine_step``
    (the engine core's whole step); or None if nothing was written."""
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
        "update_us": totals["update_ns"] / steps / 1e3,
        "bitmask_us": totals["bitmask_ns"] / steps / 1e3,
        "engine_step_us": totals["engine_step_ns"]
        / max(totals["engine_steps"], 1)
        / 1e3,
    }
