"""Teams over users: what a team costs a step, and how exactly it is paced.

1. **Step cost with 100 teams x 100 users** (vLLM's real scheduler and KV
   cache manager, no model): 10,000 users each decoding one request, limits
   far above demand. ``schedule()`` and the step's settling with every
   user in a team (nobody
   throttled, and one team of 100 throttled at 50 tok/s) against the same
   users without teams (nobody throttled, and the same 100 users throttled
   at 0.5 tok/s each), stepped side by side in shuffled rounds; a ratio is
   the median over rounds of with teams / users only in the same round.
2. **Accuracy at the engine**: a real server, a team of 4 members with a
   100 tok/s team limit, each member's own limit 40 tok/s, 2 streams each
   for ``ACC_S`` seconds; the team's and each member's rate from the
   scheduler's dispatch log (the first second left out: the initial burst).

``make bench``'s ``teams`` section; alone: ``PYTHONPATH=tests:. python -m
benchmarks.teams [--quick]`` prints the results as JSON.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.kinds import FAR_LIMIT
from benchmarks.measure import log
from benchmarks.servers import START_TIMEOUT_S
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync
from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

TEAMS, MEMBERS = 100, 100
THROTTLED_TEAM_RATE = 50.0
COST_ROUNDS = {True: 15, False: 40}
STEP_NS = 10_000_000

TEAM_LIMIT, MEMBER_LIMIT, MEMBER_STREAMS = 100.0, 40.0, 2
ACC_MEMBERS = ("crew-1", "crew-2", "crew-3", "crew-4")
ACC_S = {True: 10.0, False: 20.0}
SKIP_S = 1.0


def _teams(throttled: bool) -> dict[str, Any]:
    return {
        f"team-{t}": {
            "output_tokens_per_second": (
                THROTTLED_TEAM_RATE if throttled and t == 0 else FAR_LIMIT
            ),
            "members": [f"user-{t}-{m}" for m in range(MEMBERS)],
        }
        for t in range(TEAMS)
    }


def step_cost(model: str, rounds: int) -> dict[str, Any]:
    from harness.scheduler_sim import make_scheduler

    users = TEAMS * MEMBERS
    limits: dict[str, Any] = {"default_user_output_tokens_per_second": FAR_LIMIT}
    subjects = {}
    # The throttled team's members as users each at an even part of it:
    # the user-only plugin throttling the same users.
    each = {f"user-0-{m}": THROTTLED_TEAM_RATE / MEMBERS for m in range(MEMBERS)}
    for name, extra in (
        ("users only", {}),
        ("teams, nobody throttled", {"teams": _teams(throttled=False)}),
        ("users only, 100 throttled", {"user_output_tokens_per_second": each}),
        ("teams, one throttled", {"teams": _teams(throttled=True)}),
    ):
        h = make_scheduler(
            model,
            limits={**limits, **extra},
            max_num_seqs=users,
            num_blocks=users * 8,
            max_num_batched_tokens=users * 2,
        )
        for t in range(TEAMS):
            for m in range(MEMBERS):
                h.add(f"user-{t}-{m}", max_tokens=1_000_000)
        for _ in range(3):
            h.step(STEP_NS)
        subjects[name] = h
        log(f"teams: {name} ready")
    times: dict[str, list[int]] = {name: [] for name in subjects}
    order, rng = list(subjects), random.Random(3)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            h = subjects[name]
            h.step(STEP_NS)
            # schedule() and the step's settling (get_grammar_bitmask), as
            # the engine waits for them; not the harness's model output.
            times[name].append(h.schedule_ns)
    # Each with teams against the user-only plugin doing the same throttling.
    baselines = {
        "teams, nobody throttled": "users only",
        "teams, one throttled": "users only, 100 throttled",
    }
    return {
        "teams": TEAMS,
        "members": MEMBERS,
        "rounds": rounds,
        "throttled_team_rate": THROTTLED_TEAM_RATE,
        "subjects": {
            name: {
                "schedule_ms": statistics.median(ns) / 1e6,
                "against": baselines.get(name),
                "ratio": statistics.median(
                    a / b
                    for a, b in zip(ns, times[baselines.get(name, name)], strict=True)
                ),
            }
            for name, ns in times.items()
        },
    }


def accuracy(model: str, seconds: float, work_dir: Path) -> dict[str, Any]:
    log_path = work_dir / "dispatch-teams.csv"
    args = [
        "--default-user-output-tokens-per-second", f"{MEMBER_LIMIT:g}",
        "--output-rate-teams",
        json.dumps({"crew": {"output_tokens_per_second": TEAM_LIMIT,
                             "members": list(ACC_MEMBERS)}}),
    ]  # fmt: skip
    env = {"VLLM_OUTPUT_RATE_DISPATCH_LOG": str(log_path)}
    with running_server(
        model,
        args,
        env=env,
        start_timeout_s=START_TIMEOUT_S,
        log_dir=work_dir / "teams-server",
    ) as url:
        log("teams: server up")
        started_ns = time.monotonic_ns()
        spec = LoadSpec(
            str(url),
            model,
            [UserLoad(user, MEMBER_STREAMS, MEMBER_LIMIT) for user in ACC_MEMBERS],
            max_tokens=round(MEMBER_LIMIT * (seconds + 2)),
            duration_s=seconds,
        )
        result = run_load_sync(spec)
    dispatched = read_dispatch_log(str(log_path))
    lo = started_ns + int(SKIP_S * 1e9)
    hi = started_ns + int(seconds * 1e9)
    span_s = (hi - lo) / 1e9
    members = {
        user: sum(lo <= t < hi for t in dispatched.get(user, [])) / span_s
        for user in ACC_MEMBERS
    }
    team_rate = sum(members.values())
    return {
        "seconds": seconds,
        "team_limit": TEAM_LIMIT,
        "member_limit": MEMBER_LIMIT,
        "streams_per_member": MEMBER_STREAMS,
        "team_rate": team_rate,
        "team_ratio": team_rate / TEAM_LIMIT,
        "member_rates": members,
        "client_ok": result.ok,
    }


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    model = str(build_tiny_model())
    work_dir.mkdir(parents=True, exist_ok=True)
    return {
        "step_cost": step_cost(model, COST_ROUNDS[quick]),
        "accuracy": accuracy(model, ACC_S[quick], work_dir),
    }


if __name__ == "__main__":
    quick = "--quick" in sys.argv[1:]
    print(
        json.dumps(run(quick, Path(tempfile.mkdtemp(prefix="bench-teams-"))), indent=2)
    )
