"""10. Engine modes on vLLM's real scheduler: what each mode lifted in
issue 15 costs a step, and whether a limit holds with it on.

For each mode (plain decoding, the reference; a hybrid model's Mamba state
group with prefix caching's 'align' mode; multimodal requests, each prompt
with an image placeholder; LoRA with four adapters; pipeline parallelism's
batches in flight, two; a prefill/decode pair's decode instance, vLLM's
``DecodeBenchConnector`` for real), on vLLM's real scheduler and KV cache
manager with the tiny model's engine configuration (the harness stands in
for the model):

* cost: R = 64 requests of U = 16 users decoding, limits far above demand;
  one step of stock's and one of ours' per round, in turn first; ours /
  stock of what the engine waits for, ``schedule()`` without the settling
  (which runs beside the model) plus ``update_from_output()``, the median
  over rounds;
* accuracy: a user limited to 50 tok/s with 4 streams beside a free user
  with 4, 20 s of fake clock in 5 ms steps: the limited user's rate from its
  first paced token (after the burst) to its last over the limit, the bound
  ``(W + 0.1) x limit + 1`` over every window of its admitted tokens,
  exactly, the free user's rate against its rate with the engine to itself
  on stock vLLM, and the accounting invariant (net charges equal the tokens
  each user was dispatched, through a counting limiter).

And, for the one mode vLLM's CPU build runs here beyond speculation, the
tiny hybrid model's engines, stock against ours, in section 1b's paired
rounds through vLLM's ``LLM`` (limits far above demand; prefix caching on,
Mamba cache mode 'align'). Speculative decoding has its own section (8),
with real servers; the hybrid model also runs end to end in the tests
(``tests/e2e/test_hybrid_model.py``).

    PYTHONPATH=tests:. python -m benchmarks.engine_modes [--quick] [--json F]
        [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.measure import median_us
from harness.bounds import BURST_NS, MS, S, assert_bound
from harness.counting_limiter import CountingLimiter
from harness.scheduler_sim import SchedulerHarness, make_scheduler

REQUESTS = 64
USERS = 16
FREE_LIMIT = 1e6
LIMIT = 50.0
STREAMS = 4
STEP_NS = 5 * MS
WARM_STEPS = 5
# An image of 16 positions in every prompt of the multimodal mode.
IMAGE = (4, 16)
PROMPT_TOKENS = 24

# Per mode: make_scheduler's options, and add()'s for request number i.
Mode = tuple[dict[str, Any], Callable[[int], dict[str, Any]]]
MODES: dict[str, Mode] = {
    "plain decoding": ({}, lambda i: {}),
    "hybrid (Mamba state group)": ({"hybrid": True}, lambda i: {}),
    "multimodal (an image a prompt)": (
        {"encoder_budget": 4096},
        lambda i: {"mm_placeholders": [IMAGE]},
    ),
    "LoRA (4 adapters)": ({"max_loras": 4}, lambda i: {"lora": i % 4 + 1}),
    "pipeline parallel (2 batches in flight)": ({"in_flight": 2}, lambda i: {}),
    "P/D decode instance (KV connector)": (
        {"kv_connector": "DecodeBenchConnector"},
        lambda i: {},
    ),
}


def _scheduler(model: str, options: dict[str, Any], limits: dict[str, Any] | None):
    return make_scheduler(
        model,
        limits=limits,
        max_num_seqs=REQUESTS,
        max_num_batched_tokens=8192,
        **options,
    )


def step_cost(model: str, mode: Mode, rounds: int) -> dict[str, Any]:
    """Ours / stock per step with limits far above demand."""
    options, per_request = mode
    subjects = {
        "stock": _scheduler(model, options, None),
        "ours": _scheduler(
            model, options, {"default_user_output_tokens_per_second": FREE_LIMIT}
        ),
    }
    for h in subjects.values():
        for i in range(REQUESTS):
            h.add(
                f"user-{i % USERS}",
                prompt_len=PROMPT_TOKENS,
                max_tokens=100_000,
                **per_request(i),
            )
        for _ in range(WARM_STEPS):  # prefill, then a few decode steps
            h.step(MS)
    waited: dict[str, list[int]] = {name: [] for name in subjects}
    ratios = []
    for i in range(rounds):
        # Alternate who goes first: the second runs with warmer caches.
        for name in ("stock", "ours") if i % 2 == 0 else ("ours", "stock"):
            h = subjects[name]
            h.step(MS)
            waited[name].append(h.schedule_ns - h.settle_ns + h.update_ns)
        ratios.append(waited["ours"][-1] / waited["stock"][-1])
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "ratio": statistics.median(ratios),
        "quartiles": [q1, q3],
        "ours_us": median_us(waited["ours"]),
        "stock_us": median_us(waited["stock"]),
    }


def accuracy(model: str, mode: Mode, seconds: float) -> dict[str, Any]:
    """A limited user beside a free one, on ours, in fake time."""
    options, per_request = mode
    h: SchedulerHarness = _scheduler(
        model,
        options,
        {
            "default_user_output_tokens_per_second": FREE_LIMIT,
            "user_output_tokens_per_second": {"limited": LIMIT},
        },
    )
    limiter = CountingLimiter(FREE_LIMIT, {"limited": LIMIT}, clock=h.clock)
    h.scheduler.output_rate.use_limiter(limiter)
    _add_streams(h, "limited", per_request)
    _add_streams(h, "free", per_request)
    _run_for(h, seconds)
    h.drain()
    times = sorted(h.sampled_at("limited"))
    try:
        assert_bound(times, LIMIT)
        bound_held = True
    except AssertionError:
        bound_held = False
    dispatched = Counter(d.user for d in h.dispatches if d.samples)
    # After the burst the first instant admits (0.1 s x limit + 1 tokens).
    paced = times[int(BURST_NS * LIMIT / S) :]
    return {
        "delivered_per_limit": _rate(paced) / LIMIT,
        "bound_held": bound_held,
        "free_tok_s": _rate(h.sampled_at("free")),
        "free_alone_on_stock_tok_s": _free_alone_on_stock(model, mode, seconds),
        "charges_equal_tokens": +limiter.net == +dispatched,
        "seconds": seconds,
    }


def _free_alone_on_stock(model: str, mode: Mode, seconds: float) -> float:
    """The free user's rate with the engine to itself, on stock vLLM."""
    options, per_request = mode
    h = _scheduler(model, options, None)
    _add_streams(h, "free", per_request)
    _run_for(h, seconds)
    return _rate(h.sampled_at("free"))


def _add_streams(
    h: SchedulerHarness, user: str, per_request: Callable[[int], dict[str, Any]]
) -> None:
    """``STREAMS`` requests of ``user`` that do not end."""
    for i in range(STREAMS):
        h.add(user, prompt_len=PROMPT_TOKENS, max_tokens=100_000, **per_request(i))


def _run_for(h: SchedulerHarness, seconds: float) -> None:
    """``seconds`` of fake time in ``STEP_NS`` steps."""
    for _ in range(int(seconds * S / STEP_NS)):
        h.step(STEP_NS)


def _rate(times: list[int]) -> float:
    """Tokens per second from the first time to the last."""
    return (len(times) - 1) / ((times[-1] - times[0]) / S)


def run(
    model: str, quick: bool = False, work_dir: Path | None = None
) -> dict[str, Any]:
    """Every mode on the scheduler; with ``work_dir``, the hybrid model's
    engine comparison too (section 1b's load through vLLM's ``LLM``)."""
    rounds, seconds = (60, 5.0) if quick else (300, 20.0)
    results: dict[str, Any] = {
        "modes": {
            name: {
                "step_cost": step_cost(model, mode, rounds),
                "accuracy": accuracy(model, mode, seconds),
            }
            for name, mode in MODES.items()
        }
    }
    if work_dir is not None:
        from benchmarks.engine_throughput import engine_throughput
        from vllm_output_rate.demo.tiny_model import build_tiny_model

        hybrid = str(build_tiny_model(variant="hybrid"))
        work_dir.mkdir(parents=True, exist_ok=True)
        results["hybrid_engine"] = engine_throughput(
            hybrid, work_dir, settle=lambda: 0.0, quick=quick
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="also compare the hybrid model's engines (vLLM's LLM), here",
    )
    args = parser.parse_args()
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    results = run(str(build_tiny_model()), quick=args.quick, work_dir=args.work_dir)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    engine = results.get("hybrid_engine")
    if engine:
        print(
            f"hybrid model, engine throughput ours/stock {engine['ratio_median']:.3f}"
        )
    for name, result in results["modes"].items():
        cost, acc = result["step_cost"], result["accuracy"]
        print(
            f"{name}: step ours/stock {cost['ratio']:.3f} "
            f"({cost['ours_us']:.0f} vs {cost['stock_us']:.0f} us); "
            f"delivered/limit {acc['delivered_per_limit']:.3f}, bound "
            f"{'held' if acc['bound_held'] else 'BROKEN'}, free "
            f"{acc['free_tok_s']:.0f} tok/s (alone on stock "
            f"{acc['free_alone_on_stock_tok_s']:.0f}), charges == tokens "
            f"{acc['charges_equal_tokens']}"
        )


if __name__ == "__main__":
    main()
