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

Usage::

    PYTHONPATH=tests:. python -m benchmarks.batch_changes [--steps 3000]
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


def count(model: str, ours: bool, steps: int = STEPS) -> dict[str, Any]:
    """Run the load for ``steps`` steps on one scheduler and count."""
    limits = (
        {"default_user_output_tokens_per_second": FAR_LIMIT, **FAIRNESS_CONFIG}
        if ours
        else None
    )
    h = make_scheduler(
        model,
        limits=limits,
        max_num_seqs=ENGINE_LIMITS["max_num_seqs"],
        max_num_active_seqs=ENGINE_LIMITS["max_num_active_seqs"],
    )
    user_by_id: dict[str, str] = {}

    def add(user: str) -> None:
        request = h.add(user, prompt_len=PROMPT_TOKENS, max_tokens=MAX_TOKENS)
        user_by_id[request.request_id] = user

    for user in ENGINE_LOAD_USERS:
        add(user)
    policy = getattr(h.scheduler, "output_rate", None)
    users = set(ENGINE_LOAD_USERS)
    scheduled: Counter[str] = Counter()
    previous: frozenset[str] | None = None
    changes = kept = largest_gap = 0
    for _ in range(steps):
        output = h.step(STEP_NS)
        batch = frozenset(output.num_scheduled_tokens)
        if previous is not None and batch != previous:
            changes += 1
        previous = batch
        if policy is not None and policy._keeping:
            kept += 1
        scheduled.update(user_by_id[request_id] for request_id in batch)
        counts = [scheduled[user] for user in users]
        largest_gap = max(largest_gap, max(counts) - min(counts))
        for request_id in [r for r in user_by_id if r not in h.scheduler.requests]:
            add(user_by_id.pop(request_id))
    h.settle()
    return {
        "steps": steps,
        "changes": changes,
        "kept_steps": kept if policy is not None else None,
        "scheduled": dict(scheduled),
        "largest_gap": largest_gap,
    }


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
    args = parser.parse_args(argv)
    results = run(str(build_tiny_model()), args.steps)
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
