"""Speculative decoding with limits, ours against stock vLLM.

n-gram speculation (``kinds.SPECULATION``) on the tiny "echo" model, which
predicts its input token, so drafts are accepted:

* ``step_cost`` (no server): one scheduler step with speculation on and no
  limit binding, ours / stock on vLLM's real scheduler (the test harness;
  synthetic drafts and acceptance), R requests over R/4 users, the median
  over rounds of ours / stock in the same round: ``schedule()`` alone (what
  the engine waits for), and with the settling in ``get_grammar_bitmask()``
  and ``update_from_output()``;
* ``engine``: ``engine_throughput``'s ``speculative`` pair;
* ``servers``: a stock and an ours server up at once (each model worker on
  its own core): draft acceptance of a user far below its limit, greedy and
  at temperature 1, from vLLM's own counters, in alternating rounds; then on
  ours users at 20 and 100 tok/s with 4 streams each at temperature 1
  (drafts rejected): delivered / limit at the engine (the dispatch log) and
  the bound ``(W + 0.1) x limit + 1`` over every window, exactly.

Alone: ``PYTHONPATH=tests:. python -m benchmarks.speculative [--quick]
[--no-servers]`` (prints the results as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from benchmarks.engine_throughput import engine_throughput
from benchmarks.kinds import DRAFT_TOKENS, SPECULATION
from benchmarks.measure import median_us, metric_totals

PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."
LIMITED = {"at-20": 20, "at-100": 100}
FREE_LIMIT = 1e6
MS = 1_000_000
PROMPT_TOKENS = 16
WARM_STEPS = 5


# ----- step cost (no server) ----------------------------------------------------


def _accept(request: Any, drafts: int) -> int:
    key = f"{request.request_id}:{request.num_output_tokens}".encode()
    return zlib.crc32(key) % (drafts + 1)


def _blocks_for(requests: int, rounds: int, block_size: int) -> int:
    """KV blocks for every request to stay resident through the run: each
    step adds at most one token plus its drafts per request (at 300 rounds,
    256 requests outgrow the harness's default 10,000 blocks after about 200
    steps, and vLLM then preempts one every step: another regime than steady
    decoding)."""
    per_step = 1 + DRAFT_TOKENS
    tokens = PROMPT_TOKENS + (WARM_STEPS + rounds + 1) * per_step
    return requests * -(-tokens // block_size) + 64


def step_cost(model: str, quick: bool) -> dict[str, Any]:
    from harness.scheduler_sim import BLOCK_SIZE, make_scheduler

    results = {}
    rounds = 60 if quick else 300
    for requests in (16, 64) if quick else (16, 64, 256):
        users = max(1, requests // 4)
        subjects = {
            name: make_scheduler(
                model,
                limits=limits,
                num_spec_tokens=DRAFT_TOKENS,
                max_num_seqs=requests,
                max_num_batched_tokens=8192,
                num_blocks=_blocks_for(requests, rounds, BLOCK_SIZE),
            )
            for name, limits in (
                ("stock", None),
                ("ours", {"default_user_output_tokens_per_second": FREE_LIMIT}),
            )
        }
        for h in subjects.values():
            h.acceptance = _accept
            for i in range(requests):
                h.add(f"user-{i % users}", prompt_len=PROMPT_TOKENS, max_tokens=100_000)
            for _ in range(WARM_STEPS):  # prefill, then a few decode steps
                h.step(MS)
        parts = ("schedule", "critical", "update")
        ratios: dict[str, list[float]] = {part: [] for part in (*parts, "step")}
        times: dict[str, dict[str, list[int]]] = {
            name: {part: [] for part in parts} for name in subjects
        }
        for _ in range(rounds):
            for name, h in subjects.items():
                h.step(MS)
                times[name]["schedule"].append(h.schedule_ns)
                # What the engine waits for: schedule() without the settling
                # in get_grammar_bitmask(), which runs beside the model.
                times[name]["critical"].append(h.schedule_ns - h.settle_ns)
                times[name]["update"].append(h.update_ns)
            ours, stock = times["ours"], times["stock"]
            for part in parts:
                ratios[part].append(ours[part][-1] / stock[part][-1])
            ratios["step"].append(
                (ours["schedule"][-1] + ours["update"][-1])
                / (stock["schedule"][-1] + stock["update"][-1])
            )
        results[f"R={requests},U={users}"] = {
            "ratio": statistics.median(ratios["schedule"]),
            "stock_us": median_us(times["stock"]["schedule"]),
            "ours_us": median_us(times["ours"]["schedule"]),
            "critical_ratio": statistics.median(ratios["critical"]),
            "stock_critical_us": median_us(times["stock"]["critical"]),
            "ours_critical_us": median_us(times["ours"]["critical"]),
            "update_ratio": statistics.median(ratios["update"]),
            "stock_update_us": median_us(times["stock"]["update"]),
            "ours_update_us": median_us(times["ours"]["update"]),
            "step_ratio": statistics.median(ratios["step"]),
        }
    return results


# ----- servers ----------------------------------------------------------------


# Draft acceptance: rounds of this many requests (200 tokens each, 2 at a
# time) of a user far below its limit, on both servers in turn. Seeded
# requests do not help: two stock servers given the same seeds did not
# produce the same drafts.
ACCEPTANCE_ROUNDS = 6
ACCEPTANCE_REQUESTS = 16
ACCEPTANCE_MODES = {"greedy": 0.0, "temperature 1": 1.0}
COUNTERS = {
    "drafted": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "throttled_request_steps": "vllm:output_rate_throttled_request_steps_total",
}


def _complete(url: str, model: str, bodies: list[dict[str, Any]]) -> None:
    """Send ``bodies`` as completions of the user "free", 2 at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    # No keep-alive: a connection the server closed while idle (the other
    # server's round) would fail the next request.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=url, timeout=300, limits=no_reuse) as client:

        def post(body: dict[str, Any]) -> None:
            client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": PROMPT,
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "vllm_xargs": {"output_rate_user": "free"},
                }
                | body,
            ).raise_for_status()

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(post, bodies))


def _acceptance(urls: dict[str, str], model: str, rounds: int) -> dict[str, Any]:
    """Per mode and server: each round's counter deltas and acceptance
    rate, the rate pooled over the rounds and the rounds' range. The
    servers take turns, the order swapping every round."""
    results: dict[str, Any] = {}
    for mode, temperature in ACCEPTANCE_MODES.items():
        per_server: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for number in range(rounds):
            for name in list(urls)[:: 1 if number % 2 == 0 else -1]:
                before = metric_totals(urls[name])
                bodies = [{"temperature": temperature}] * ACCEPTANCE_REQUESTS
                _complete(urls[name], model, bodies)
                after = metric_totals(urls[name])
                counts = {
                    key: after.get(metric, 0.0) - before.get(metric, 0.0)
                    for key, metric in COUNTERS.items()
                }
                counts["rate"] = counts["accepted"] / max(counts["drafted"], 1.0)
                per_server[name].append(counts)
        results[mode] = {
            name: {
                "rounds": counts,
                "rate": sum(r["accepted"] for r in counts)
                / max(sum(r["drafted"] for r in counts), 1.0),
                "min": min(r["rate"] for r in counts),
                "max": max(r["rate"] for r in counts),
            }
            for name, counts in per_server.items()
        }
    return results


# The dispatch log stamps tokens with the clock reading of their step's
# reservation, so windows between stamps are the limiter's own; this is
# floating-point rounding only.
BOUND_ROUNDING_TOKENS = 1e-6


def bound_excess(times_ns: list[int], rate: float) -> float:
    """The most tokens any window of the sorted times holds beyond
    ``(W + 0.1) x rate + 1`` (negative: that much room left)."""
    worst, lowest = float("-inf"), None
    for k, t in enumerate(times_ns):
        f = k - rate * t / 1e9
        if lowest is not None:
            worst = max(worst, f - lowest - 0.1 * rate)
        lowest = f if lowest is None else min(lowest, f)
    return worst


def _accuracy(log_path: str) -> dict[str, dict[str, float]]:
    from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

    times = read_dispatch_log(log_path)
    figures = {}
    for user, limit in LIMITED.items():
        received = times.get(user, [])
        # Steady state: from the second second to the end.
        steady = [t for t in received if t >= received[0] + 1_000_000_000]
        span_s = (steady[-1] - steady[0]) / 1e9
        excess = bound_excess(sorted(received), limit)
        figures[user] = {
            "limit": limit,
            "delivered_per_limit": (len(steady) - 1) / span_s / limit,
            "tokens": len(received),
            "bound_excess_tokens": excess,
            "bound_held": excess <= BOUND_ROUNDING_TOKENS,
        }
    return figures


def _server_args() -> dict[str, list[str]]:
    """Stock's flags, and ours' with every user far below its limit except
    the two of the accuracy part."""
    stock = ["--speculative-config", json.dumps(SPECULATION), "--max-num-seqs", "16"]
    ours = [
        *stock,
        "--default-user-output-tokens-per-second",
        str(FREE_LIMIT),
        "--user-output-tokens-per-second",
        json.dumps(LIMITED),
    ]
    return {"stock": stock, "ours": ours}


@contextmanager
def _server_pair(model: str, work_dir: Path, dispatch_log: str) -> Iterator[dict]:
    """A stock and an ours server up at once, each model worker on its own
    core, both warmed up; ours writes its dispatch log."""
    from vllm_output_rate.demo.server import running_server

    args = _server_args()
    envs = {
        "stock": {"VLLM_PLUGINS": ""},
        "ours": {"VLLM_OUTPUT_RATE_DISPATCH_LOG": dispatch_log},
    }
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                running_server(
                    model,
                    args[name],
                    env={**envs[name], "VLLM_CPU_OMP_THREADS_BIND": str(core)},
                    log_dir=work_dir / name,
                )
            )
            for core, name in enumerate(("stock", "ours"))
        }
        for url in urls.values():
            _complete(url, model, [{"temperature": 0.0, "max_tokens": 16}])
        yield urls


def servers(model: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    """On one server pair: acceptance in alternating rounds, then accuracy
    on ours (its dispatch log is complete once the server stopped)."""
    from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync

    log_path = str(work_dir / "dispatch.csv")
    results: dict[str, Any] = {}
    with _server_pair(model, work_dir, log_path) as urls:
        results["acceptance"] = _acceptance(
            urls, model, 2 if quick else ACCEPTANCE_ROUNDS
        )
        load = run_load_sync(
            LoadSpec(
                base_url=urls["ours"],
                model=model,
                users=[UserLoad(u, 4, limit) for u, limit in LIMITED.items()],
                prompt=PROMPT,
                max_tokens=200,
                duration_s=8 if quick else 20,
                extra_body={"temperature": 1.0},
            )
        )
        if not load.ok:
            raise RuntimeError(load.error_summary())
    results["accuracy"] = _accuracy(log_path)
    return results


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    """Everything above, for ``make bench``."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    return {
        "step_cost": step_cost(str(build_tiny_model()), quick),
        "engine": engine_throughput("speculative", work_dir / "engine", quick),
        "servers": servers(str(build_tiny_model(variant="echo")), quick, work_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-servers", action="store_true", help="step cost only")
    args = parser.parse_args(argv)
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    if args.no_servers:
        results = {"step_cost": step_cost(str(build_tiny_model()), args.quick)}
    else:
        results = run(args.quick, Path(tempfile.mkdtemp(prefix="bench-speculative-")))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    raise SystemExit(main())
