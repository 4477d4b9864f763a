"""How often the saturated engine's batch changes, ours against stock vLLM.

Every change of the set of requests scheduled in a step costs vLLM's model
runner a rebuild of its persistent batch (``_update_states``: requests added
and removed, inputs, sampling metadata); on the tiny model that is a
visible part of ours' longer step on the saturated load
(docs/architecture.md, "Turns"). This counts the changes at scheduler level,
with vLLM's real scheduler and KV cache manager and a fake clock, on the
saturated pair's load (``kinds``): two users of 18 streams with requests of
64 tokens, each that ends replaced at once, 40 resident, 3 active slots,
ours with the weights and floors and limits far above demand. Stock runs each request to
its end; ours hands the slots out by weighted service, and a slot passes
between the two users when one is ``TURN_TOKENS`` ahead.

Also counted: ours' steps that kept the last ranking's batch
(``kept_batch.py``) and the largest gap between the two users' tokens.
Deterministic (no timing), so one run is the figure.

Alone: ``PYTHONPATH=tests:. python -m benchmarks.batch_changes [--steps N]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from typing import Any

from benchmarks.kinds import FAIRNESS, FAR_LIMIT, SATURATED_LIMITS, SATURATED_USERS
from harness.scheduler_sim import make_scheduler
from vllm_output_rate.scheduling.step import StepMode

STEP_NS = 1_000_000
PROMPT_TOKENS = 12
MAX_TOKENS = 64
STEPS = 3000


def kept_this_step(policy: Any) -> bool:
    """Whether ours' last step kept the last ranking's batch."""
    return bool(policy.step.mode is StepMode.KEPT)


class EngineLoad:
    """The saturated load on one scheduler, ended requests replaced."""

    def __init__(self, model: str, ours: bool, shortcuts: bool = True) -> None:
        limits = (
            {
                "default_user_output_tokens_per_second": FAR_LIMIT,
                **FAIRNESS,
                "shortcuts": shortcuts,
            }
            if ours
            else None
        )
        self.h = make_scheduler(
            model,
            limits=limits,
            max_num_seqs=SATURATED_LIMITS["max_num_seqs"],
            max_num_active_seqs=SATURATED_LIMITS["max_num_active_seqs"],
        )
        self.policy = getattr(self.h.scheduler, "output_rate", None)
        self.user_by_id: dict[str, str] = {}
        for user in SATURATED_USERS:
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
        return self.policy is not None and kept_this_step(self.policy)


def count(
    model: str, ours: bool, steps: int = STEPS, shortcuts: bool = True
) -> dict[str, Any]:
    """Run the load for ``steps`` steps on one scheduler and count; also the
    median time of ``schedule()`` (what vLLM's engine waits for before the
    model runs) and of the settling in ``get_grammar_bitmask()`` (beside the
    model), as context: it is one run on a shared machine."""
    load = EngineLoad(model, ours, shortcuts)
    schedule_ns: list[int] = []
    settle_ns: list[int] = []
    users = set(SATURATED_USERS)
    scheduled: Counter[str] = Counter()
    previous: frozenset[str] | None = None
    changes = kept = largest_gap = 0
    for _ in range(steps):
        batch = load.step()
        schedule_ns.append(load.h.schedule_ns - load.h.settle_ns)
        settle_ns.append(load.h.settle_ns)
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
        "schedule_us": statistics.median(schedule_ns) / 1e3,
        "settle_us": statistics.median(settle_ns) / 1e3,
    }


def run(model: str, steps: int = STEPS) -> dict[str, Any]:
    """Both schedulers on the same load (for the fair-shares section)."""
    return {
        "steps": steps,
        "streams": len(SATURATED_USERS),
        "max_tokens": MAX_TOKENS,
        "stock": count(model, ours=False, steps=steps),
        "ours": count(model, ours=True, steps=steps),
        # The reference path (shortcuts off): the same decisions, what the
        # kept batch and settling beside the model save.
        "reference": count(model, ours=True, steps=steps, shortcuts=False),
    }


def main(argv: list[str] | None = None) -> int:
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_changes")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    results = run(str(build_tiny_model()), args.steps)
    for name in ("stock", "ours", "reference"):
        row = results[name]
        print(
            f"{name}: {row['changes']} batch changes in {row['steps']} steps, "
            f"kept {row['kept_steps']}, scheduled {row['scheduled']}, "
            f"largest gap {row['largest_gap']}, schedule() "
            f"{row['schedule_us']:.1f} us, settling {row['settle_us']:.1f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
