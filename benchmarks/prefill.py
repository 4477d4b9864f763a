"""A fair share of each step's tokens: a light user beside another user's
long prompts, stock vLLM against ours (issue 38).

1. **Servers** (``--max-num-seqs 64 --max-num-batched-tokens 512``, ours
   with limits far above demand, so only the step's token shares act, and
   ours with the hog's prompts paced at 3,000 tok/s besides): the
   light user sends short streamed requests (8 tokens out) one after
   another, alone and then beside ``hog``, which keeps 16 requests of
   ~1,400-token prompts of random words going (one token out each). Per
   server: the light user's time to first token (p50, p95) and latency
   (p50) at the client, alone and beside, and the hog's answers and prompt
   tokens per second from its start to its last answer. The servers run one
   after the other with the same load.
2. **Step cost with U = 1,000 users prefilling** (vLLM's real scheduler
   and KV cache manager, no model): each user keeps one request of a
   1,500-token prompt going, 8,192 tokens a step; ``schedule()`` of ours
   (shares on, and off) against stock's, stepped side by side in shuffled
   rounds; a ratio is the median over rounds of ours / stock in the same
   round.

``make bench``'s ``prefill`` section; alone: ``PYTHONPATH=tests:. python -m
benchmarks.prefill [--quick]`` prints the results as JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from benchmarks.kinds import FAR_LIMIT
from benchmarks.measure import against_stock, log
from benchmarks.servers import START_TIMEOUT_S
from harness.prefill_load import (
    ENGINE_ARGS,
    HOG_STREAMS,
    light_requests,
    start_hog,
)
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.loadtest.summary import percentile

OURS_FLAGS = ["--default-user-output-tokens-per-second", f"{FAR_LIMIT:g}"]
OURS_ENV = {"VLLM_PLUGINS": "output_rate,output_rate_http"}
# The hog's prompt tokens paced (prompt_limits.py); nobody else's bind.
HOG_PROMPT_RATE = 3_000.0
PROMPT_RATE = "ours, hog's prompts at 3,000 tok/s"
SERVERS = {
    "stock": ([], {"VLLM_PLUGINS": ""}),
    "ours": (OURS_FLAGS, OURS_ENV),
    PROMPT_RATE: (
        [
            *OURS_FLAGS,
            "--default-user-prompt-tokens-per-second",
            f"{FAR_LIMIT:g}",
            "--user-prompt-tokens-per-second",
            f'{{"hog": {HOG_PROMPT_RATE:g}}}',
        ],
        OURS_ENV,
    ),
}
LIGHT_REQUESTS = {True: 15, False: 40}  # quick, full
# Step cost: users, prompt tokens each, the step's tokens, rounds.
COST_USERS, COST_PROMPT, COST_BUDGET = 1_000, 1_500, 8_192
COST_ROUNDS = {True: 20, False: 60}


def _figures(ttfts: list[float], latencies: list[float]) -> dict[str, float | None]:
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": percentile(ttfts, 95),
        "latency_p50_s": statistics.median(latencies),
    }


async def _measure_server(url: str, model: str, count: int) -> dict[str, Any]:
    client = AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    await light_requests(client, model, 5)  # warm-up
    alone = _figures(*await light_requests(client, model, count))
    stop, prompts = asyncio.Event(), []
    hogs = start_hog(client, model, stop, prompts)
    await asyncio.sleep(3)  # the hog's prompts fill every step
    started = time.monotonic()
    beside = _figures(*await light_requests(client, model, count))
    stop.set()
    answered = sum(await asyncio.gather(*hogs))
    hog_s = time.monotonic() - started + 3
    await client.close()
    return {
        "alone": alone,
        "beside": beside,
        "ttft_p50_ratio": beside["ttft_p50_s"] / alone["ttft_p50_s"],
        "ttft_p95_ratio": beside["ttft_p95_s"] / alone["ttft_p95_s"],
        "latency_p50_ratio": beside["latency_p50_s"] / alone["latency_p50_s"],
        # From the hog's start to its last answer: its answers, and all their
        # prompt tokens but each one's last (computed with its output token).
        "hog_answers_per_s": answered / hog_s,
        "hog_prompt_tokens_per_s": sum(n - 1 for n in prompts) / hog_s,
    }


def servers(model: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (flags, env) in SERVERS.items():
        with running_server(
            model,
            [*ENGINE_ARGS, *flags],
            env=env,
            start_timeout_s=START_TIMEOUT_S,
            log_dir=work_dir / name,
        ) as url:
            log(f"prefill: {name} server up")
            results[name] = asyncio.run(
                _measure_server(str(url), model, LIGHT_REQUESTS[quick])
            )
    return results


def _distinct_prompt(rng: random.Random) -> list[int]:
    """A prompt no other request shares a block of: the prefix cache finds
    nothing (the harness's default prompts repeat every 400 requests, and a
    cached one finishes at once)."""
    return [rng.randrange(10, 400) for _ in range(COST_PROMPT)]


def _keep_prefilling(h: Any, seen: set[str], rng: random.Random) -> None:
    """Replace every finished request with a new one of its user."""
    for request_id in [r for r in h.finished if r not in seen]:
        seen.add(request_id)
        h.add(h.users[request_id], prompt=_distinct_prompt(rng), max_tokens=1)


def step_cost(model: str, rounds: int) -> dict[str, Any]:
    from harness.scheduler_sim import make_scheduler

    limits: dict[str, Any] = {"default_user_output_tokens_per_second": FAR_LIMIT}
    subjects: dict[str, tuple[Any, set[str], random.Random]] = {}
    for name, config in (
        ("stock", None),
        ("ours", limits),
        ("ours, shares off", {**limits, "fair_step_tokens": False}),
    ):
        h = make_scheduler(
            model,
            limits=config,
            num_blocks=COST_USERS * (COST_PROMPT // 16 + 4),
            max_num_seqs=COST_USERS,
            max_num_batched_tokens=COST_BUDGET,
        )
        # The same prompts, in the same order, for every subject.
        prompts = random.Random(11)
        for u in range(COST_USERS):
            h.add(f"user-{u}", prompt=_distinct_prompt(prompts), max_tokens=1)
        for _ in range(4):
            h.step(1_000_000)
        subjects[name] = (h, set(), prompts)
    times: dict[str, list[int]] = {name: [] for name in subjects}
    shared_steps = 0
    order, rng = list(subjects), random.Random(7)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            h, seen, prompts = subjects[name]
            _keep_prefilling(h, seen, prompts)
            started = time.perf_counter_ns()
            h.step(1_000_000)
            times[name].append(time.perf_counter_ns() - started)
            if name == "ours":
                shared_steps += h.scheduler.output_rate.step.token_shares is not None
    return {
        "users": COST_USERS,
        "prompt_tokens": COST_PROMPT,
        "step_tokens": COST_BUDGET,
        "rounds": rounds,
        "shared_steps": shared_steps,
        "subjects": against_stock(times),
    }


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model())
    return {
        "hog_streams": HOG_STREAMS,
        "light_requests": LIGHT_REQUESTS[quick],
        "servers": servers(model, quick, work_dir),
        "step_cost": step_cost(model, COST_ROUNDS[quick]),
    }


if __name__ == "__main__":
    import tempfile

    quick = "--quick" in sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as folder:
        print(json.dumps(run(quick, Path(folder)), indent=2))
