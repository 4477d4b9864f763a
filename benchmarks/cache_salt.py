"""What per-user prefix-cache isolation costs: one long prompt sent by
several users in turn, on ours without and with ``--output-rate-cache-salt
user``.

Per round a fresh prompt of about 2,000 tokens (a new first sentence, so no
earlier round's blocks match) goes to ``USERS`` users one after the other,
each request asking for one token. Without the salt, every user after the
first finds the prompt cached; with it, each user computes it again. Figures
per server: the share of looked-up prompt tokens the prefix cache served
(``vllm:prefix_cache_hits_total`` over ``..._queries_total``) and the median
latency of the later users' requests (prefill plus one token), and its
ratio salted over unsalted: the price of a cache miss on a shared prefix.
The first user of a round misses on both and is left out of the latency.
The servers run one after the other, same flags but the salt.

``make bench``'s ``cache_salt`` section; alone: ``PYTHONPATH=tests:. python
-m benchmarks.cache_salt [--quick]`` prints the results as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.kinds import FAR_LIMIT
from benchmarks.measure import log, median, metric_totals
from benchmarks.servers import SERVER_ARGS, START_TIMEOUT_S
from vllm_output_rate.demo.server import running_server

USERS = 8
SENTENCES = 110  # about 2,000 prompt tokens on the tiny model
ROUNDS = {True: 3, False: 10}  # quick, full
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
SERVERS = {
    "unsalted": [],
    "salted": ["--output-rate-cache-salt", "user"],
}


def prompt(round_: int) -> str:
    body = " ".join(
        f"fact {i}: the {i % 7}th river flows east." for i in range(SENTENCES)
    )
    return f"Round {round_} begins. {body}"


def one_token(url: str, model: str, user: str, text: str) -> float:
    """Seconds to answer a one-token completion of ``text`` for ``user``."""
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": 1,
        "vllm_xargs": {"output_rate_user": user},
    }
    started = time.perf_counter()
    answer = httpx.post(url + "/v1/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - started
    answer.raise_for_status()
    return elapsed


def measure_server(url: str, model: str, rounds: int) -> dict[str, Any]:
    one_token(url, model, "warm-up", "hello")  # first-request costs out of the way
    later: list[float] = []
    queries = hits = 0.0
    for round_ in range(rounds):
        text = prompt(round_)
        before = metric_totals(url)
        for u in range(USERS):
            elapsed = one_token(url, model, f"user-{u}", text)
            if u:
                later.append(elapsed)
        time.sleep(1.0)  # the counters follow the engine's step stats
        after = metric_totals(url)
        queries += after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)
        hits += after.get(HITS, 0.0) - before.get(HITS, 0.0)
    return {
        "hit_share": hits / queries if queries else None,
        "later_user_latency_s": median(later),
        "requests": rounds * USERS,
    }


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    model = str(build_tiny_model())
    results: dict[str, Any] = {"users": USERS, "rounds": ROUNDS[quick]}
    for name, flags in SERVERS.items():
        args = [
            *SERVER_ARGS,
            "--default-user-output-tokens-per-second",
            f"{FAR_LIMIT:g}",
            *flags,
        ]
        env = {"VLLM_PLUGINS": "output_rate,output_rate_http"}
        with running_server(
            model,
            args,
            env=env,
            start_timeout_s=START_TIMEOUT_S,
            log_dir=Path(work_dir) / name,
        ) as url:
            log(f"cache_salt: {name} server up")
            results[name] = measure_server(url, model, ROUNDS[quick])
    salted = results["salted"]["later_user_latency_s"]
    unsalted = results["unsalted"]["later_user_latency_s"]
    results["latency_salted_over_unsalted"] = (
        salted / unsalted if salted and unsalted else None
    )
    return results


if __name__ == "__main__":
    import tempfile

    quick = "--quick" in sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="bench-cache-salt-") as folder:
        print(json.dumps(run(quick, Path(folder)), indent=2))
