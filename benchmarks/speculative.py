"""Benchmark: the modes issue 15 lifted, ours against stock vLLM side by side.

Speculative decoding (n-gram, 4 draft tokens, the tiny "echo" model, which
predicts its input token, so drafts are accepted):

* ``step_cost`` (no server): one scheduler step with speculative decoding on
  and no limit binding, ours / stock, on vLLM's real scheduler (the test
  harness; synthetic drafts and acceptance), R requests over R/4 users. The
  median over rounds of (ours / stock in the same round).
* ``acceptance``: a user far below its limit, greedy then at temperature 1:
  vLLM's own counters (accepted / draft tokens), ours / stock.
* ``accuracy``: users at 20 and 100 tok/s with 4 streams each at temperature
  1 (so drafts are rejected): delivered / limit at the engine (the dispatch
  log: the tokens each user received, at the time their step was
  dispatched), and the bound ``(W + 0.1) x limit + 1`` on every window.
* ``throughput``: output tokens/s of 8 streams far below their limits, ours
  / stock (engine counter ``vllm:generation_tokens_total`` over the load).

Hybrid and multimodal models, pipeline parallelism and LoRA are measured at
scheduler level by their tests only (tests/scheduling/test_model_kinds.py):
vLLM's CPU build here runs none of them end to end.

Usage::

    python -m benchmarks.speculative [--quick] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."
LIMITED = {"at-20": 20, "at-100": 100}
FREE_LIMIT = 1e6
MS = 1_000_000


# ----- step cost (no server) ----------------------------------------------------


def _accept(request: Any, drafts: int) -> int:
    key = f"{request.request_id}:{request.num_output_tokens}".encode()
    return zlib.crc32(key) % (drafts + 1)


def step_cost(model: str, quick: bool) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from harness.scheduler_sim import make_scheduler

    results = {}
    for requests in (16, 64) if quick else (16, 64, 256):
        users = max(1, requests // 4)
        subjects = {
            name: make_scheduler(
                model,
                limits=limits,
                num_spec_tokens=4,
                max_num_seqs=requests,
                max_num_batched_tokens=8192,
            )
            for name, limits in (
                ("stock", None),
                ("ours", {"default_user_output_tokens_per_second": FREE_LIMIT}),
            )
        }
        for h in subjects.values():
            h.acceptance = _accept
            for i in range(requests):
                h.add(f"user-{i % users}", prompt_len=16, max_tokens=100_000)
            for _ in range(5):  # prefill, then a few decode steps
                h.step(MS)
        ratios, times = [], {name: [] for name in subjects}
        for _ in range(60 if quick else 300):
            for name, h in subjects.items():
                h.step(MS)
                times[name].append(h.schedule_ns)
            ratios.append(times["ours"][-1] / times["stock"][-1])
        results[f"R={requests},U={users}"] = {
            "ratio": statistics.median(ratios),
            "stock_us": statistics.median(times["stock"]) / 1e3,
            "ours_us": statistics.median(times["ours"]) / 1e3,
        }
    return results


# ----- servers ----------------------------------------------------------------


def _metrics(url: str) -> dict[str, float]:
    import httpx

    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            name, _, value = match.groups()
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def _load(url: str, model: str, users: list[Any], seconds: float, **body: Any):
    from vllm_output_rate.loadtest import LoadSpec, run_load_sync

    spec = LoadSpec(
        base_url=url,
        model=model,
        users=users,
        prompt=PROMPT,
        max_tokens=200,
        duration_s=seconds,
        extra_body=body,
    )
    result = run_load_sync(spec)
    if not result.ok:
        raise RuntimeError(result.error_summary())
    return result


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _acceptance(url: str, model: str, seconds: float) -> dict[str, float]:
    from vllm_output_rate.loadtest import UserLoad

    rates = {}
    for label, temperature in (("greedy", 0.0), ("temperature 1", 1.0)):
        before = _metrics(url)
        _load(url, model, [UserLoad("free", 2)], seconds, temperature=temperature)
        after = _metrics(url)
        drafted = _delta(after, before, "vllm:spec_decode_num_draft_tokens_total")
        accepted = _delta(after, before, "vllm:spec_decode_num_accepted_tokens_total")
        rates[label] = accepted / drafted if drafted else float("nan")
    return rates


def _throughput(url: str, model: str, seconds: float) -> float:
    from vllm_output_rate.loadtest import UserLoad

    before, started = _metrics(url), time.monotonic()
    users = [UserLoad(f"free-{i}", 2) for i in range(4)]
    _load(url, model, users, seconds, temperature=0.0)
    elapsed = time.monotonic() - started
    return _delta(_metrics(url), before, "vllm:generation_tokens_total") / elapsed


def _accuracy(log_path: str) -> dict[str, dict[str, float]]:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from harness.bounds import assert_bound
    from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

    times = read_dispatch_log(log_path)
    figures = {}
    for user, limit in LIMITED.items():
        received = times.get(user, [])
        # Steady state: from the second second to the end.
        steady = [t for t in received if t >= received[0] + 1_000_000_000]
        span_s = (steady[-1] - steady[0]) / 1e9
        try:
            assert_bound(received, limit)
            bound = True
        except AssertionError:
            bound = False
        figures[user] = {
            "limit": limit,
            "delivered_per_limit": (len(steady) - 1) / span_s / limit,
            "tokens": len(received),
            "bound_held": bound,
        }
    return figures


def servers(model: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    from vllm_output_rate.demo.server import running_server
    from vllm_output_rate.loadtest import UserLoad

    seconds = 4 if quick else 10
    base_args = [
        "--speculative-config",
        json.dumps(SPECULATION),
        "--max-num-seqs",
        "16",
    ]
    limits = {**LIMITED, **{f"free-{i}": FREE_LIMIT for i in range(4)}}
    ours_args = [
        *base_args,
        "--default-user-output-tokens-per-second",
        str(FREE_LIMIT),
        "--user-output-tokens-per-second",
        json.dumps(limits),
    ]
    log_path = str(work_dir / "dispatch.csv")
    results: dict[str, Any] = {}
    for name, args, env in (
        ("stock", base_args, {"VLLM_PLUGINS": ""}),
        ("ours", ours_args, {"VLLM_OUTPUT_RATE_DISPATCH_LOG": log_path}),
    ):
        with running_server(model, args, env=env, log_dir=work_dir / name) as url:
            _load(url, model, [UserLoad("warm-up", 1)], 1.0)
            figures: dict[str, Any] = {
                "acceptance": _acceptance(url, model, seconds),
                "throughput_tok_s": _throughput(url, model, seconds),
            }
            if name == "ours":
                users = [UserLoad(u, 4, limit) for u, limit in LIMITED.items()]
                _load(url, model, users, 2 * seconds, temperature=1.0)
            results[name] = figures
    results["accuracy"] = _accuracy(log_path)  # written when the server stopped
    return results


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    """Everything above, for ``make bench`` (``benchmarks.suite``)."""
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    return {
        "step_cost": step_cost(str(build_tiny_model()), quick),
        "servers": servers(str(build_tiny_model(variant="echo")), quick, work_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-servers", action="store_true", help="step cost only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    results: dict[str, Any] = {
        "command": "python -m benchmarks.speculative " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "step_cost": step_cost(str(build_tiny_model()), args.quick),
    }
    if not args.no_servers:
        work_dir = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
        echo = str(build_tiny_model(variant="echo"))
        results["servers"] = servers(echo, args.quick, work_dir)
        results["work_dir"] = str(work_dir)
    from benchmarks.report.speculative import table

    text = table(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    raise SystemExit(main())
