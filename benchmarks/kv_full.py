"""Fair shares with the KV cache full, ours against stock vLLM.

vLLM's real scheduler and KV cache manager, no model: the contested load of
``fair_shares.ranking_cost`` (``contested_scheduler``: ``REQUESTS`` resident
requests, active slots half of them, room for ``BLOCKS_PER_REQUEST`` KV
blocks a request, limits far above demand), each request growing a token a
step. After ~190 steps the cache is full: vLLM
preempts, and preempted requests wait to compute their tokens again, while
the fair shares rank users with nothing running first. Subjects: stock; ours
with U = 256 users (four requests each) and U = 10,000 (one request each),
half of the users at weight 2. Figures per subject: requests scheduled a
step over the last ``JUDGED_STEPS`` steps (mean and least), tokens sampled
and tokens computed (prompts again after a preemption included) over all
``STEPS``, and preemptions; the target is ours sampling at least stock's
tokens at each U.

``make bench``'s ``kv_full`` section; alone: ``PYTHONPATH=tests:. python -m
benchmarks.kv_full`` prints the results as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.fair_shares import BLOCKS_PER_REQUEST, contested_scheduler
from benchmarks.measure import log

REQUESTS = 1024
STEPS = 320
JUDGED_STEPS = 100
USERS = (256, 10_000)
STEP_NS = 1_000_000


def subject(model: str, users: int | None) -> dict[str, Any]:
    """One scheduler (stock when ``users`` is None) through ``STEPS`` steps."""
    h = contested_scheduler(model, REQUESTS, users)
    counts, computed = [], 0
    for _ in range(STEPS):
        scheduled = h.step(STEP_NS).num_scheduled_tokens
        counts.append(len(scheduled))
        computed += sum(scheduled.values())
    judged = counts[-JUDGED_STEPS:]
    return {
        "scheduled_per_step": sum(judged) / len(judged),
        "least_per_step": min(judged),
        "sampled": sum(h.received_tokens().values()),
        "computed": computed,
        "preemptions": h.preemptions,
    }


def run(quick: bool = False, work_dir: Path | None = None) -> dict[str, Any]:
    """The same in quick runs: the cache fills only after ~190 steps."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    model = str(build_tiny_model())
    subjects: dict[str, Any] = {}
    for users in (None, *USERS):
        name = "stock" if users is None else f"U={users:,}"
        subjects[name] = subject(model, users)
        log(f"kv_full: {name} {subjects[name]}")
    stock = subjects["stock"]["sampled"]
    for figures in subjects.values():
        figures["sampled_over_stock"] = figures["sampled"] / stock
    return {
        "requests": REQUESTS,
        "active": REQUESTS // 2,
        "blocks_per_request": BLOCKS_PER_REQUEST,
        "steps": STEPS,
        "judged_steps": JUDGED_STEPS,
        "subjects": subjects,
    }


if __name__ == "__main__":
    json.dump(run(), sys.stdout, indent=2)
    print()
