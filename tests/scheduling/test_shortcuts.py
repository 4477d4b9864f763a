"""The step's shortcuts change where the time goes, never what is decided.

Randomized workloads run twice on vLLM's real scheduler and KV cache manager
with a fake clock: once with the shortcuts (``scheduling/shortcuts.py``: vLLM's
own hook in uncontested steps, the kept batch with its set-aside, settling
beside the model) and once on the reference path (``"shortcuts": false``).
Every step must dispatch the same requests with the same tokens (and drafts),
and the limiter must hold the same net charges per user after every step.

The workloads mix users with and without binding limits, weights and floors,
more streams than active or resident slots, scarce KV blocks, FCFS and
priority scheduling, arrivals and aborts while the load runs, synchronous and
asynchronous scheduling and speculative decoding; and, once per group, a
crowd: tens of users with hundreds of requests on half as many active slots
(ranked by the rotations, the batch alone in vLLM's loop), newcomers and
requests ending as it runs. Each group of workloads must also reach every
shortcut, so that the comparison cannot pass vacuously.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.counting_limiter import CountingLimiter
from harness.scheduler_sim import SchedulerHarness, make_scheduler
from vllm_output_rate.scheduling.step import StepMode

MS = 1_000_000
STEP_NS = 10 * MS
STEPS = 200
CROWD_STEPS = 120
FREE = 1e6  # a limit no step can reach
# One workload of each shape per group: a saturated engine where no limit
# binds (kept batches, set-aside), the same with late outputs (no batch
# kept: shortcuts.py) or drafts (kept batches with our hook), binding limits
# on more streams than slots, scarce KV blocks, a light load that leaves
# steps uncontested, and anything at random.
SHAPES = ("saturated", "saturated-late", "throttled", "scarce-kv", "light", "mixed")


@dataclass
class Workload:
    seed: int
    shape: str
    limits: dict[str, Any]
    engine: dict[str, Any]
    # (user, streams, prompt_len, max_tokens, priority) added before step 1
    initial: list[tuple[str, int, int, int, int]]
    # step -> what happens before it: ("add", user, prompt_len, max_tokens,
    # priority) or ("abort", the n-th request added)
    events: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)


def workload(seed: int) -> Workload:
    rng = random.Random(seed)
    shape = SHAPES[seed % len(SHAPES)]
    users = [f"u{i}" for i in range(rng.randint(2, 5))]
    rates: dict[str, float] = {}
    weights: dict[str, float] = {}
    floors: dict[str, float] = {}
    for user in users:
        if not shape.startswith("saturated") and rng.random() < 0.5:
            rates[user] = rng.choice([20.0, 50.0, 150.0])
        if rng.random() < 0.4:
            weights[user] = rng.choice([0.5, 2.0, 3.0])
    if shape == "mixed" and rng.random() < 0.5:
        floored = rng.choice(users)
        floors[floored] = min(rates.get(floored, FREE), 40.0)
    limits: dict[str, Any] = {"default_user_output_tokens_per_second": FREE}
    if rates:
        limits["user_output_tokens_per_second"] = rates
    if weights:
        limits["user_output_weight"] = weights
    if floors:
        limits["user_min_output_tokens_per_second"] = floors
    max_num_seqs = rng.choice([4, 8, 16, 32])
    engine: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "max_num_active_seqs": rng.choice([None, 2, max(1, max_num_seqs // 2)]),
        "num_blocks": 10_000,
        "policy": rng.choice(["fcfs", "fcfs", "priority"]),
        "is_async": rng.random() < 0.4,
        "num_spec_tokens": rng.choice([0, 0, 2]),
    }
    if shape.startswith("saturated"):
        engine["max_num_active_seqs"] = rng.choice([2, 3, 4])
        engine["max_num_seqs"] = 32
        engine["policy"] = "fcfs"
        late = shape == "saturated-late"
        engine["is_async"] = late and rng.random() < 0.5
        engine["num_spec_tokens"] = 2 if late and not engine["is_async"] else 0
    if shape == "light":
        engine["max_num_seqs"], engine["max_num_active_seqs"] = 64, None
    if shape == "scarce-kv":
        engine["num_blocks"] = rng.choice([40, 64, 96])
    priorities = engine["policy"] == "priority"
    initial = [
        (
            user,
            rng.randint(1, 2 if shape == "light" else 10),
            rng.choice([4, 8, 24, 60]),
            rng.choice([20, 60, 200]),
            rng.randint(0, 2) if priorities else 0,
        )
        for user in users
    ]
    events: dict[int, list[tuple[Any, ...]]] = {}
    added = sum(streams for _, streams, *_ in initial)
    for step in range(1, STEPS):
        if rng.random() < 0.15:
            events.setdefault(step, []).append(
                (
                    "add",
                    rng.choice(users),
                    rng.choice([4, 16, 40]),
                    rng.choice([5, 30, 100]),
                    rng.randint(0, 2) if priorities else 0,
                )
            )
            added += 1
        if rng.random() < 0.05:
            events.setdefault(step, []).append(("abort", rng.randrange(added)))
    return Workload(seed, shape, limits, engine, initial, events)


def crowd(seed: int) -> Workload:
    """Tens of users, hundreds of requests, half as many active slots, most
    users covered (a few limits, weights, sometimes a floor or priority
    scheduling, teams in half of them), users arriving and requests ending
    while it runs."""
    rng = random.Random(seed)
    users = [f"c{i}" for i in range(rng.randint(20, 60))]
    limits: dict[str, Any] = {"default_user_output_tokens_per_second": FREE}
    weights = {u: rng.choice([0.5, 2.0, 3.0]) for u in users if rng.random() < 0.4}
    if weights:
        limits["user_output_weight"] = weights
    if rng.random() < 0.3:
        limits["user_output_tokens_per_second"] = {users[0]: 50.0}
    if rng.random() < 0.25:
        limits["user_min_output_tokens_per_second"] = {users[1]: 40.0}
    policy = "priority" if rng.random() < 0.2 else "fcfs"
    # Half the crowds have teams (hierarchical shares), drawn apart so that
    # the rest of the workload stays what it was.
    team_rng = random.Random(seed + 10_000)
    if team_rng.random() < 0.5:
        names = [f"t{i}" for i in range(team_rng.randint(2, 4))]
        teams: dict[str, dict[str, Any]] = {
            name: {"output_tokens_per_second": FREE, "members": []} for name in names
        }
        for user in users:
            if team_rng.random() < 0.6:
                teams[team_rng.choice(names)]["members"].append(user)
        if team_rng.random() < 0.5:
            teams[names[0]]["weight"] = 3.0
        limits["teams"] = teams
    initial = [
        (
            user,
            rng.randint(1, 10),
            rng.choice([4, 8, 20]),
            rng.choice([40, 120, 400]),
            0,
        )
        for user in users
    ]
    requests = sum(streams for _, streams, *_ in initial)
    max_num_seqs = requests + rng.choice([-40, 0, 40])
    engine: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "max_num_active_seqs": max_num_seqs // 2,
        "max_num_batched_tokens": 4096,
        "num_blocks": 20_000,
        "policy": policy,
        "is_async": rng.random() < 0.25,
        "num_spec_tokens": 2 if rng.random() < 0.15 else 0,
    }
    newcomers = [f"n{i}" for i in range(10)]
    events: dict[int, list[tuple[Any, ...]]] = {}
    for step in range(1, CROWD_STEPS):
        if rng.random() < 0.3:
            user = rng.choice(users + newcomers)
            event = ("add", user, rng.choice([4, 16]), rng.choice([10, 60]), 0)
            events.setdefault(step, []).append(event)
            requests += 1
        if rng.random() < 0.05:
            events.setdefault(step, []).append(("abort", rng.randrange(requests)))
    return Workload(seed, "crowd", limits, engine, initial, events)


@dataclass
class Run:
    # Per step: the dispatches (request, tokens, samples, drafts), then the
    # limiter's net charges per user once the step is settled.
    steps: list[tuple[list[tuple[str, int, bool, int]], dict[str, int]]]
    modes: Counter[str]


def run(model_path: str, load: Workload, *, shortcuts: bool, steps: int = STEPS) -> Run:
    limits = dict(load.limits, shortcuts=shortcuts)
    h: SchedulerHarness = make_scheduler(model_path, limits=limits, **load.engine)
    policy = h.scheduler.output_rate
    limiter = CountingLimiter(
        limits["default_user_output_tokens_per_second"],
        limits.get("user_output_tokens_per_second"),
        clock=h.clock,
    )
    policy.use_limiter(limiter)
    ids: list[str] = []

    def add(user: str, prompt_len: int, max_tokens: int, priority: int) -> None:
        request = h.add(
            user, prompt_len=prompt_len, max_tokens=max_tokens, priority=priority
        )
        ids.append(request.request_id)

    for user, streams, prompt_len, max_tokens, priority in load.initial:
        for _ in range(streams):
            add(user, prompt_len, max_tokens, priority)
    done = []
    modes: Counter[str] = Counter()
    for step in range(1, steps):
        for event in load.events.get(step, ()):
            if event[0] == "add":
                add(*event[1:])
            elif ids[event[1]] in h.scheduler.requests:
                h.abort(ids[event[1]])
        before = len(h.dispatches)
        h.step(STEP_NS)
        dispatched = sorted(
            (d.request_id, d.num_tokens, d.samples, d.drafts)
            for d in h.dispatches[before:]
        )
        done.append((dispatched, dict(+limiter.net)))
        modes[
            policy.step.mode.value + ("+vllm-hook" if policy.step.vllm_hook else "")
        ] += 1
        modes["set-aside"] += bool(policy.step.set_aside)
        modes["rotated"] += getattr(policy.step, "rotated", False)
    h.drain()
    return Run(done, modes)


GROUPS = 12
PER_GROUP = len(SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("group", range(GROUPS))
def test_shortcuts_dispatch_and_charge_what_the_reference_does(
    tiny_model_path: str, group: int
) -> None:
    seen: Counter[str] = Counter()
    seeds = range(group * PER_GROUP, (group + 1) * PER_GROUP)
    for load in [*map(workload, seeds), crowd(group)]:
        seed, steps = load.seed, CROWD_STEPS if load.shape == "crowd" else STEPS
        fast = run(tiny_model_path, load, shortcuts=True, steps=steps)
        reference = run(tiny_model_path, load, shortcuts=False, steps=steps)
        assert not reference.modes[StepMode.KEPT.value]
        for number, (a, b) in enumerate(
            zip(fast.steps, reference.steps, strict=True), start=1
        ):
            assert a[0] == b[0], (
                f"seed {seed} ({load.shape}, {load.engine}) step {number}: "
                f"dispatched {a[0]} with shortcuts, {b[0]} without"
            )
            assert a[1] == b[1], (
                f"seed {seed} ({load.shape}, {load.engine}) step {number}: "
                f"net charges {a[1]} with shortcuts, {b[1]} without"
            )
        seen.update(fast.modes)
    # Every shortcut was taken somewhere in the group.
    assert seen["uncontested+vllm-hook"], seen
    # (A kept batch with our hook needs drafts: not every group draws them.)
    assert seen["kept+vllm-hook"] and seen["set-aside"], seen
    assert seen["rotated"] and seen["contested+vllm-hook"], seen
