"""Benchmark: one user's limit across engines sharing a store (issue 14).

Three measurements, each against a real redis-server started here:

* ``accuracy``: two engines' leases on one fake clock (the tests' lease
  simulation, tests/harness/store_sim.py), users split 3:1, 1:1 and on one
  engine only, demand far above the limits, 20 simulated seconds:
  delivered / limit per user (target 0.98-1.02) and the global bound.
* ``round_trips``: store round trips and users asked per engine per
  simulated second, for 10, 100 and 1,000 active users: round trips stay
  at one per refresh cycle; the users asked grow with active users and the
  lease rate (one renewal per user per half lease), not with tokens.
* ``step_cost``: vLLM's real scheduler (no model) with 10,000 distinct
  active users, one request each, steady decoding with no limit binding:
  the median ``schedule()`` time with the local limiter and with leases
  from the store (ratio measured side by side, interleaved steps).
* ``engine`` (with ``--engines``; starts two real engines, so run it under
  the CPU lock): the engine-throughput benchmark's load (vLLM's ``LLM``, 32
  streams, limits far above demand), ours with the store against ours
  without, paired rounds (target >= 0.98).

Usage: ``python -m benchmarks.store [--quick] [--engines] [--json PATH]``
(PYTHONPATH must hold tests/ and the repository root, as ``make bench``
sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness.fake_clock import FakeClock
from harness.redis_server import RedisServer
from harness.store_sim import SimEngine, merged
from vllm_output_rate.store.settings import StoreSettings

NS = 1_000_000_000
MS = 1_000_000


def _run(engines: list[SimEngine], clock: FakeClock, seconds: float) -> None:
    for tick in range(round(seconds * 100)):  # 10 ms steps, 0.1 s refresh
        clock.advance(10 * MS)
        if tick % 10 == 0:
            for engine in engines:
                engine.refresh()
        for engine in engines:
            engine.step()


def accuracy(url: str, seconds: float) -> dict[str, Any]:
    limits = {"split-3:1": 100.0, "split-1:1": 20.0, "only-a": 50.0, "only-b": 7.5}
    demand = {
        "split-3:1": (3, 1),
        "split-1:1": (2, 2),
        "only-a": (4, 0),
        "only-b": (0, 1),
    }
    clock = FakeClock(1_000 * NS)
    settings = StoreSettings(url=url, key_prefix=f"bench-acc-{time.time_ns()}")
    engines = [SimEngine.create(name, settings, clock, 1000.0, limits) for name in "ab"]
    for user, (on_a, on_b) in demand.items():
        engines[0].set_demand(user, on_a)
        engines[1].set_demand(user, on_b)
    _run(engines, clock, seconds)
    start = 1_000 * NS + 2 * NS
    rows = {}
    for user, limit in limits.items():
        per_engine = [
            sum(t >= start for t in e.dispatched.get(user, [])) for e in engines
        ]
        span = (clock.now_ns - start) / NS
        rows[user] = {
            "limit": limit,
            "streams": demand[user],
            "delivered_per_engine": per_engine,
            "ratio": sum(per_engine) / (limit * span),
            "max_in_1s_window": _max_window(merged(engines, user), NS),
            "bound_1s": 1.1 * limit + 2,
        }
    for engine in engines:
        engine.close()
    return rows


def _max_window(times: list[int], width_ns: int) -> int:
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - width_ns:
            j += 1
        best = max(best, i - j + 1)
    return best


def round_trips(url: str, seconds: float) -> dict[str, Any]:
    rows = {}
    for users in (10, 100, 1000):
        clock = FakeClock(1_000 * NS)
        settings = StoreSettings(
            url=url, key_prefix=f"bench-rt-{users}-{time.time_ns()}"
        )
        engines = [SimEngine.create(n, settings, clock, 5.0) for n in "ab"]
        for i in range(users):
            engines[i % 2].set_demand(f"user-{i}", 1)
        _run(engines, clock, seconds)
        counters = [e.limiter.counters for e in engines]
        rows[users] = {
            "round_trips_per_s": statistics.mean(
                c.exchanges / seconds for c in counters
            ),
            "users_asked_per_s": statistics.mean(c.asks / seconds for c in counters),
            "tokens_per_s": sum(
                len(ts) for e in engines for ts in e.dispatched.values()
            )
            / seconds
            / 2,
            "rtt_mean_ms": statistics.mean(
                1e3 * c.rtt_sum_s / max(1, c.exchanges) for c in counters
            ),
        }
        for engine in engines:
            engine.close()
    return rows


def step_cost(url: str, users: int, steps: int) -> dict[str, Any]:
    from harness.scheduler_sim import make_scheduler
    from vllm_output_rate.demo.tiny_model import build_tiny_model
    from vllm_output_rate.store.leases import LeasedLimiter
    from vllm_output_rate.store.redis_store import RedisLeaseStore
    from vllm_output_rate.store.refresher import Refresher

    model = str(build_tiny_model())
    limit = 1e9  # never binds
    harnesses = {}
    for kind in ("local", "store"):
        clock = FakeClock(1_000 * NS)
        harness = make_scheduler(
            model,
            limits={"default_user_output_tokens_per_second": limit},
            clock=clock,
            max_num_seqs=users,
            max_num_batched_tokens=max(2048, users * 2),
            # 128 tokens per request: warm-up and the timed steps never
            # run out of KV blocks (a preemption would skew the step time).
            num_blocks=users * 8 + 64,
        )
        refresher = None
        if kind == "store":
            settings = StoreSettings(url=url, key_prefix=f"bench-step-{time.time_ns()}")
            limiter = LeasedLimiter(limit, {}, settings, clock=clock)
            harness.scheduler.output_rate.use_limiter(limiter)
            refresher = Refresher(limiter, RedisLeaseStore(settings), "bench")
        for i in range(users):
            harness.add(f"user-{i}", prompt_len=4, max_tokens=100_000)
        harnesses[kind] = (harness, refresher)
    # Prefill, and every user's first lease: until every request decodes.
    for kind, (harness, refresher) in harnesses.items():
        for _ in range(50):
            if refresher is not None:
                refresher.run_once(now_us=harness.clock.now_ns // 1000)
            output = harness.step(10 * MS)
            if len(output.num_scheduled_tokens) == users:
                break
        else:
            raise AssertionError(f"{kind}: not every request decodes after 50 steps")
    times: dict[str, list[float]] = {"local": [], "store": []}
    for _ in range(steps):
        for kind, (harness, _) in harnesses.items():
            output = harness.step(10 * MS)  # with the model's synthetic output
            assert len(output.num_scheduled_tokens) == users  # all decoding
            # schedule() and the step's settling, not the synthetic output.
            times[kind].append(harness.schedule_ns / 1e9)
    leased = harnesses["store"][0].scheduler.output_rate.leases
    assert leased is not None and not leased.store_snapshot()["blocked_users"]
    local_ms = 1e3 * statistics.median(times["local"])
    store_ms = 1e3 * statistics.median(times["store"])
    return {
        "users": users,
        "local_ms": local_ms,
        "store_ms": store_ms,
        "ratio": store_ms / local_ms,
    }


def engine(url: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    from benchmarks.engine_throughput import (
        STORE_KIND,
        STORE_URL_ENV,
        engine_throughput,
    )
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    os.environ[STORE_URL_ENV] = url
    work_dir.mkdir(parents=True, exist_ok=True)
    result = engine_throughput(
        str(build_tiny_model()),
        work_dir,
        settle=lambda: 0.0,
        quick=quick,
        kinds=("ours", STORE_KIND),
    )
    return {
        "rounds": result["rounds"],
        "ratio_median": result["ratio_median"],
        "ratio_quartiles": result["ratio_quartiles"],
    }


def run(quick: bool, engines: bool, work_dir: Path) -> dict[str, Any]:
    with RedisServer() as server:
        result = {
            "accuracy": accuracy(server.url, 10 if quick else 20),
            "round_trips": round_trips(server.url, 5 if quick else 10),
            "step_cost": step_cost(server.url, 10_000, 20 if quick else 60),
        }
        if engines:
            result["engine"] = engine(server.url, quick, work_dir)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--engines", action="store_true")
    parser.add_argument("--work-dir", default="results/store-bench")
    args = parser.parse_args(argv)
    result = run(args.quick, args.engines, Path(args.work_dir))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2, default=str)
    from benchmarks.report.store import tables

    print(tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
