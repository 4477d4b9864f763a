"""How often the saturated engine's batch changes, ours against stock vLLM.

Every change of the set of requests scheduled in a step costs vLLM's model
runner a rebuild of its persistent batch (``_update_states``: requests added
and removed, inputs, sampling metadata); on the tiny model that is a
visible part of ours' longer step on section 9's saturated load
(docs/architecture.md, "Turns"). This counts the changes at scheduler level,
with vLLM's real scheduler and KV cache manager and a fake clock, on section
9's engine load: ``ENGINE_LOAD_USERS`` (two users of 18 streams) with
requests of 64 tokens, each that ends replaced at once, on
``ENGINE_LIMITS`` (40 resident, 3 active slots), ours with section 9's
weights and floors and limits far above demand. Stock runs each request to
its end; ours hands the slots out by weighted service, and a slot passes
between the two users when one is ``TURN_TOKENS`` ahead.

Also counted: ours' steps that kept the last ranking's batch
(``kept_batch.py``) and the largest gap between the two users' tokens.
Deterministic (no timing), so one run is the figure.

``--time ROUNDS`` times the scheduler instead (``time_side_by_side``):
stock and ours stepped in turn in one process, each step's ``schedule()``,
``get_grammar_bitmask()`` and ``update_from_output()`` timed by the harness,
and ``schedule()`` alone (what the engine waits for), ours' kept and ranked
steps apart. Noisy machines: compare the two columns of one run.

Usage::

    PYTHONPATH=tests:. python -m benchmarks.batch_changes [--steps 3000] [--time 3]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from benchmarks.fair_shares import (
    ENGINE_LIMITS,
    ENGINE_LOAD_USERS,
    FAIRNESS_CONFIG,
)
from harness.scheduler_sim import make_scheduler

STEP_NS = 1_000_000
PROMPT_TOKENS = 12
MAX_TOKENS = 64
STEPS = 3000
FAR_LIMIT = 1e6


class EngineLoad:
    """Section 9's engine load on one scheduler, ended requests replaced."""

    def __init__(self, model: str, ours: bool) -> None:
        limits = (
            {"default_user_output_tokens_per_second": FAR_LIMIT, **FAIRNESS_CONFIG}
            if ours
            else None
        )
        self.h = make_scheduler(
            model,
            limits=limits,
            max_num_seqs=ENGINE_LIMITS["max_num_seqs"],
            max_num_active_seqs=ENGINE_LIMITS["max_num_active_seqs"],
        )
        self.policy = getattr(self.h.scheduler, "output_rate", None)
        self.user_by_id: dict[str, str] = {}
        for user in ENGINE_LOAD_USERS:
            self._add(user)

    def _add(self, user: str) -> None:
        request = self.h.add(user, prompt_len=PROMPT_TOKENS, max_tokens=MAX_TOKENS)
        self.user_by_id[request.request_id] = user

    def step(self) -> dict[str, str]:
        """One step; returns the requests it scheduled, with their users."""
        output = self.h.step(STEP_NS)
        batch = {r: self.user_by_id[r] for r in output.num_scheduled_tokens}
        requests = self.h.scheduler.requests
        for request_id in [r for r in self.user_by_id if r not in requests]:
            self._add(self.user_by_id.pop(request_id))
        return batch

    @property
    def kept(self) -> bool:
        """Whether the last step kept the last ranking's batch (ours)."""
        return self.policy is not None and self.policy._keeping

    @property
    def step_ns(self) -> int:
        """The scheduler's time in the last step: schedule() and the
        update_from_output() of the step fed back."""
        return self.h.schedule_ns + self.h.update_ns

    @property
    def critical_ns(self) -> int:
        """schedule() alone in the last step: what vLLM's engine waits for
        before the model runs (ours settles the step after that)."""
        return self.h.schedule_ns - self.h.settle_ns


def count(model: str, ours: bool, steps: int = STEPS) -> dict[str, Any]:
    """Run the load for ``steps`` steps on one scheduler and count."""
    load = EngineLoad(model, ours)
    users = set(ENGINE_LOAD_USERS)
    scheduled: Counter[str] = Counter()
    previous: frozenset[str] | None = None
    changes = kept = largest_gap = 0
    for _ in range(steps):
        batch = load.step()
        if previous is not None and batch.keys() != previous:
            changes += 1
        previous = frozenset(batch)
        kept += load.kept
        scheduled.update(batch.values())
        counts = [scheduled[user] for user in users]
        largest_gap = max(largest_gap, max(counts) - min(counts))
    load.h.settle()
    return {
        "steps": steps,
        "changes": changes,
        "kept_steps": kept if load.policy is not None else None,
        "scheduled": dict(scheduled),
        "largest_gap": largest_gap,
    }


def time_side_by_side(
    model: str, steps: int = STEPS, warmup: int = 200
) -> dict[str, float]:
    """The scheduler's mean time a step (µs), stock and ours stepped in
    turn in one process so that both see the same machine state; ours'
    kept and ranked steps apart. ``*_us``: schedule(), the settling in
    get_grammar_bitmask() and update_from_output(); ``*_critical_us``:
    schedule() alone, what vLLM's engine waits for before the model runs
    (it calls get_grammar_bitmask() once the step has gone to the model
    worker). The harness's own work is outside."""
    stock, ours = EngineLoad(model, ours=False), EngineLoad(model, ours=True)
    for _ in range(warmup):
        stock.step()
        ours.step()
    stock_ns: list[tuple[int, int]] = []
    kept_ns: list[tuple[int, int]] = []
    ranked_ns: list[tuple[int, int]] = []
    for _ in range(steps):
        stock.step()
        stock_ns.append((stock.step_ns, stock.critical_ns))
        ours.step()
        (kept_ns if ours.kept else ranked_ns).append((ours.step_ns, ours.critical_ns))
    stock.h.settle()
    ours.h.settle()

    def mean_us(samples: list[tuple[int, int]], part: int) -> float:
        return sum(s[part] for s in samples) / max(len(samples), 1) / 1e3

    row: dict[str, float] = {"kept_steps": len(kept_ns)}
    for part, suffix in ((0, "_us"), (1, "_critical_us")):
        row["stock" + suffix] = mean_us(stock_ns, part)
        row["ours" + suffix] = mean_us(kept_ns + ranked_ns, part)
        row["kept" + suffix] = mean_us(kept_ns, part)
        row["ranked" + suffix] = mean_us(ranked_ns, part)
    return row


def run(model: str, steps: int = STEPS) -> dict[str, Any]:
    """Both schedulers on the same load (for section 9's report)."""
    return {
        "steps": steps,
        "streams": len(ENGINE_LOAD_USERS),
        "max_tokens": MAX_TOKENS,
        "stock": count(model, ours=False, steps=steps),
        "ours": count(model, ours=True, steps=steps),
    }


def main(argv: list[str] | None = None) -> int:
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_changes")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--time",
        type=int,
        metavar="ROUNDS",
        default=0,
        help="time the scheduler instead, stock and ours side by side",
    )
    args = parser.parse_args(argv)
    model = str(build_tiny_model())
    for _ in range(args.time):
        row = time_side_by_side(model, args.steps)
        for suffix, what in (("_us", "whole"), ("_critical_us", "schedule()")):
            stock_us, ours_us = row["stock" + suffix], row["ours" + suffix]
            print(
                f"{what}: stock {stock_us:.1f} us, ours {ours_us:.1f} us "
                f"({ours_us - stock_us:+.1f}): kept steps "
                f"{row['kept' + suffix]:.1f} us ({row['kept_steps']:.0f}), "
                f"ranked {row['ranked' + suffix]:.1f} us"
            )
    if args.time:
        return 0
    results = run(model, args.steps)
    for name in ("stock", "ours"):
        row = results[name]
        print(
            f"{name}: {row['changes']} batch changes in {row['steps']} steps, "
            f"kept {row['kept_steps']}, scheduled {row['scheduled']}, "
            f"largest gap {row['largest_gap']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
