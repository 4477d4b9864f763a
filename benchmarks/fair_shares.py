"""Fair shares on a saturated engine, ours against stock vLLM side by side.

When the engine itself is the bottleneck (3 active slots, limits far above
demand), stock vLLM serves in queue order, ours by weighted service
(``kinds.WEIGHTS``, ``kinds.FLOORS``). Two servers with the same engine
flags run at once, and each scenario's load runs on each in turn, in rounds:

* ``weights``: ``many`` (weight 1, 16 streams) beside ``light`` (weight 2, 2
  streams): light : many should be 2 : 1 on ours;
* ``equal``: two users of 16 streams each: 1 : 1;
* ``floor``: ``hog`` (weight 20, 32 streams) beside ``floored`` (floor 60
  tok/s, 2 streams), who by weight alone would get 1/21 of the engine.

Each stream sends one request of 4,000 tokens, longer than the load, so
every user stays backlogged; the judged user's streams open first. Ours'
shares are read at the engine (its dispatch log), over the part of the
window in which every user was served (``harness.shares.served_window``):
vLLM's API server here can deliver tokens seconds late. Stock has no
dispatch log and is read at the client. Then ``engine``: throughput on the
engine without HTTP (``engine_throughput``'s ``saturated`` pair), judged
there; ``batch_changes``; and ``ranking_cost``: the scheduler step when every
step is contested, at U = 256 and 10,000 users (no server), with the Python
and builtin calls the plugin's code makes per step, counted in a few untimed
steps (counting slows them): they should grow with the users served in a
step, not with R. That part alone: ``PYTHONPATH=tests:. python -m
benchmarks.fair_shares [--requests N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import vllm_output_rate
from benchmarks import batch_changes
from benchmarks.engine_throughput import engine_throughput
from benchmarks.kinds import FAIRNESS, FAR_LIMIT, SATURATED_LIMITS
from benchmarks.measure import against_stock, log, median, wait_until_drained
from harness.bounds import S as NS_PER_S
from harness.shares import served_window

ENGINE_ARGS = ["--max-model-len", "4096"] + [
    arg
    for name, value in SATURATED_LIMITS.items()
    for arg in ("--" + name.replace("_", "-"), str(value))
]
SCENARIOS: dict[str, dict[str, int]] = {
    "weights": {"many": 16, "light": 2},
    "equal": {"even-a": 16, "even-b": 16},
    "floor": {"hog": 32, "floored": 2},
}
MAX_TOKENS = 4000  # outlasts a load: a stream gets at most a token a step
WARM_S = 5.0
FULL_S, QUICK_S = 16.0, 10.0
FULL_ROUNDS, QUICK_ROUNDS = 2, 1
RANKING_USERS = (256, 10_000)
COUNTED_STEPS = 3  # untimed steps in which the plugin's calls are counted
BLOCKS_PER_REQUEST = 8
PLUGIN_DIR = str(Path(vllm_output_rate.__file__).parent)


def judged_user(streams: dict[str, int]) -> str | None:
    """The user a scenario judges: its second (light, even-b, floored);
    nobody in the one-user warm-up."""
    users = list(streams)
    return users[1] if len(users) > 1 else None


def opening_order(streams: dict[str, int]) -> list[str]:
    """The judged user first: with both servers busy on 2 cores, the last
    of 34 connections can wait past the client's connect timeout."""
    judged = judged_user(streams)
    return [judged, *(u for u in streams if u != judged)] if judged else list(streams)


def client_shares(records: list[Any], users: list[str], end_s: float) -> dict:
    """Per-user tokens/s and share at the client over ``[WARM_S, end_s]``."""
    span = end_s - WARM_S
    tokens = {
        user: sum(
            n
            for r in records
            if r.user == user
            for t, n in r.chunks
            if WARM_S <= t <= end_s
        )
        for user in users
    }
    total = sum(tokens.values())
    return {
        user: {
            "tok_s": tokens[user] / span,
            "share": tokens[user] / total if total else None,
        }
        for user in users
    } | {"total_tok_s": total / span}


def engine_shares(
    dispatched: dict[str, list[int]], users: list[str], start_ns: int, end_ns: int
) -> dict[str, Any]:
    """Per-user tokens/s and share at the engine, over the part of the
    window in which every user was served (all of it if never together)."""
    begin, end = served_window(dispatched, users, start_ns, end_ns, 0)
    if end <= begin:
        begin, end = start_ns, end_ns
    span_s = max(end - begin, 1) / NS_PER_S
    tokens = {
        user: sum(begin <= t <= end for t in dispatched.get(user, ())) for user in users
    }
    total = sum(tokens.values())
    return {
        user: {
            "tok_s": tokens[user] / span_s,
            "share": tokens[user] / total if total else None,
        }
        for user in users
    } | {"window_s": span_s}


def _run_load(
    url: str,
    model: str,
    streams: dict[str, int],
    seconds: float,
    dispatch_log: Path | None,
) -> dict[str, Any]:
    from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync
    from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

    spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(user, streams[user]) for user in opening_order(streams)],
        prompt="fair shares on a full engine",
        max_tokens=MAX_TOKENS,
        duration_s=seconds,
        request_timeout_s=seconds,  # every request still running is cut
    )
    started_ns = time.monotonic_ns()
    result = run_load_sync(spec)
    figures = client_shares(result.records, list(streams), seconds)
    if dispatch_log is not None:
        time.sleep(1.5)  # the log is written a second behind the engine
        figures["engine"] = engine_shares(
            read_dispatch_log(str(dispatch_log)),
            list(streams),
            started_ns + int(WARM_S * NS_PER_S),
            started_ns + int(seconds * NS_PER_S),
        )
    # Requests cut at the load's end are expected; any other failure counts.
    figures["failed"] = sum(
        1 for r in result.records if r.error and "timed out" not in r.error
    )
    return figures


def servers(model: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    """Every scenario on both servers, in rounds; per scenario and server
    the judged user's median share and tokens/s (at the engine on ours)."""
    from vllm_output_rate.demo.server import running_server
    from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV

    dispatch_log = work_dir / "ours-dispatch.csv"
    seconds = QUICK_S if quick else FULL_S
    ours_args = [
        *ENGINE_ARGS,
        "--default-user-output-tokens-per-second",
        f"{FAR_LIMIT:g}",
        *(
            arg
            for key, value in FAIRNESS.items()
            for arg in ("--" + key.replace("_", "-"), json.dumps(value))
        ),
    ]
    runs: list[dict[str, Any]] = []
    with (
        running_server(
            model, ENGINE_ARGS, env={"VLLM_PLUGINS": ""}, log_dir=work_dir / "stock"
        ) as stock_url,
        running_server(
            model,
            ours_args,
            env={DISPATCH_LOG_ENV: str(dispatch_log)},
            log_dir=work_dir / "ours",
        ) as ours_url,
    ):
        urls = {"stock": stock_url, "ours": ours_url}
        for url in urls.values():  # warm-up: the first requests are slow
            _run_load(url, model, {"warm-up": 2}, WARM_S + 1, None)
        for round_ in range(QUICK_ROUNDS if quick else FULL_ROUNDS):
            for scenario, streams in SCENARIOS.items():
                for server, url in urls.items():
                    log(f"fair shares: {scenario} on {server}, round {round_ + 1}")
                    wait_until_drained(url, timeout_s=60)
                    log_path = dispatch_log if server == "ours" else None
                    figures = _run_load(url, model, streams, seconds, log_path)
                    runs.append(
                        {"scenario": scenario, "server": server, "round": round_}
                        | figures
                    )
    return {"runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario and server: the judged user's median share and tokens/s
    (at the engine where its dispatch log was read) and failed requests."""
    summary: dict[str, Any] = {}
    for scenario, streams in SCENARIOS.items():
        user = list(streams)[1]
        summary[scenario] = {"user": user}
        for server in ("stock", "ours"):
            mine = [
                r for r in runs if r["scenario"] == scenario and r["server"] == server
            ]
            judged = [r.get("engine", r)[user] for r in mine]
            summary[scenario][server] = {
                "share": median(j["share"] for j in judged),
                "tok_s": median(j["tok_s"] for j in judged),
                "failed": sum(r["failed"] for r in mine),
            }
    return summary


def ranking_cost(model: str, requests: int, rounds: int) -> dict[str, Any]:
    """One step with every slot contested: R resident requests over U users
    (half at weight 2), active slots R / 2, limits far above demand, against
    stock with the same settings; schedulers stepped in shuffled rounds, the
    median over rounds of ours / stock in the same round."""
    subjects = {}
    for users in (None, *RANKING_USERS):
        h = contested_scheduler(model, requests, users)
        for _ in range(8):  # prefill everyone, then the steady state
            h.step(1_000_000)
        subjects["stock" if users is None else f"U={users:,}"] = h
    times: dict[str, list[int]] = {name: [] for name in subjects}
    order, rng = list(subjects), random.Random(7)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            started = time.perf_counter_ns()
            subjects[name].step(1_000_000)
            times[name].append(time.perf_counter_ns() - started)
    return {
        "requests": requests,
        "rounds": rounds,
        "subjects": {
            name: {
                **figures,
                "plugin_calls_per_step": plugin_calls_per_step(subjects[name]),
            }
            for name, figures in against_stock(times).items()
        },
    }


def contested_scheduler(model: str, requests: int, users: int | None) -> Any:
    """A scheduler (``scheduler_sim``) holding ``requests`` resident
    requests over ``users`` users (half at weight 2; stock vLLM when None),
    active slots half of them, room for 8 KV blocks a request, limits far
    above demand: every step is contested."""
    from harness.scheduler_sim import make_scheduler

    limits = None
    if users is not None:
        limits = {
            "default_user_output_tokens_per_second": 1e9,
            "user_output_weight": {f"user-{i}": 2.0 for i in range(0, users, 2)},
        }
    h = make_scheduler(
        model,
        limits=limits,
        num_blocks=requests * BLOCKS_PER_REQUEST,
        max_num_seqs=requests,
        max_num_active_seqs=requests // 2,
        max_num_batched_tokens=requests * 16,
    )
    rng = random.Random(1)
    for k in range(requests):
        h.add(
            f"user-{k % (users or 1)}",
            prompt_len=8 + rng.randrange(16),
            max_tokens=1_000_000,
        )
    return h


def plugin_calls_per_step(h: Any) -> float:
    """Calls into the plugin's Python code, and builtin calls it makes, per
    step (a generator counts once per item it yields)."""
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(
            PLUGIN_DIR
        ):
            calls += 1

    sys.setprofile(count)
    try:
        for _ in range(COUNTED_STEPS):
            h.step(1_000_000)
    finally:
        sys.setprofile(None)
    return calls / COUNTED_STEPS


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    """For ``make bench``: the servers, the engine, batch changes and the
    ranking's step cost."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model())
    return {
        "servers": servers(model, quick, work_dir),
        "engine": engine_throughput("saturated", work_dir / "engine", quick),
        "batch_changes": batch_changes.run(model),
        "ranking_cost": ranking_cost(model, *((1024, 10) if quick else (4096, 30))),
    }


def main(argv: list[str] | None = None) -> int:
    """The ranking's step cost alone (``make bench`` runs the rest too)."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    cost = ranking_cost(str(build_tiny_model()), args.requests, args.rounds)
    print(json.dumps(cost, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
