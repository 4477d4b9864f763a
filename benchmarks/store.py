"""Engines sharing one user's limit through a store (issue 14): its cost.

Against a real redis-server started here:

* ``round_trips``: two engines' leases on one fake clock (the tests' lease
  simulation, ``tests/harness/store_sim.py``) with 10, 100 and 1,000 active
  users: store round trips and users asked per engine per simulated second.
  Round trips stay at one per refresh cycle; the users asked grow with the
  active users and the lease rate, not with tokens.
* ``engine`` (with ``--engines``): ``engine_throughput``'s ``store`` pair,
  ours leasing from the store against ours without, paired rounds.

That the limit holds across engines (delivered / limit, the global bound)
is tested, on the same simulation, in ``tests/store/test_leases.py``.

Alone: ``PYTHONPATH=tests:. python -m benchmarks.store [--quick] [--engines]``
(prints the results as JSON).
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

from benchmarks.engine_throughput import engine_throughput
from benchmarks.kinds import STORE_URL_ENV
from harness.fake_clock import FakeClock
from harness.redis_server import RedisServer
from harness.store_sim import SimEngine
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


def engine(url: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    """The ``store`` pair's paired rounds: ours with the store against ours."""
    os.environ[STORE_URL_ENV] = url  # the engine children inherit it
    return engine_throughput("store", work_dir, quick)


def run(quick: bool, engines: bool, work_dir: Path) -> dict[str, Any]:
    with RedisServer() as server:
        result = {
            "round_trips": round_trips(server.url, 5 if quick else 10),
        }
        if engines:
            result["engine"] = engine(server.url, quick, work_dir)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engines", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=Path("results/store-bench"))
    args = parser.parse_args(argv)
    print(json.dumps(run(args.quick, args.engines, args.work_dir), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
