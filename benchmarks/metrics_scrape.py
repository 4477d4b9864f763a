"""The cost of a metrics scrape against the number of configured users.

One real vLLM OpenAI server with the plugin; its user table grows through
the admin endpoint to each size in ``SIZES`` (10^3, 10^5, 10^6 users with
their own limit), and at each size ``DISTINCT_USERS`` distinct users send a
request (so per-user records exist and more users want a label than there
are). Then ``GET /metrics`` is timed ``SCRAPES`` times (median) with its
size, and one full pass over the admin stats endpoint's pages. The figure
that matters is the ratio of each size's scrape to the smallest one's: the
``user`` label is bounded, so it should stay near 1 (before the bound, the
issue measured 13.5 MB and 2.1 s at 200,000 users).

Run alone (it is self-contained; it prints the report's table)::

    PYTHONPATH=tests:. .venv/bin/python -m benchmarks.metrics_scrape [--quick]

``make bench`` runs it as section 6; presented by
``benchmarks.report.metrics_scrape``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model

SIZES = (1_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 100_000)
DISTINCT_USERS = 300
SCRAPES = 15
ADMIN_KEY = "bench-admin-key"
PUT_BATCH = 100_000  # users per admin request
TARGET_RATIO = 1.5  # scrape time at the largest size / at the smallest


def _configure_users(url: str, start: int, stop: int) -> float:
    """Give users ``start..stop`` their own limit; returns seconds taken."""
    began = time.perf_counter()
    for first in range(start, stop, PUT_BATCH):
        rates = {
            f"tenant-{i}": 5.0 + i % 7
            for i in range(first, min(stop, first + PUT_BATCH))
        }
        answer = httpx.put(
            url + "/v1/output_rate/limits",
            json={"user_output_tokens_per_second": rates},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=600,
        )
        answer.raise_for_status()
    return time.perf_counter() - began


def _traffic(url: str, model: str, users: int, offset: int) -> None:
    """One short request for each of ``users`` distinct configured users."""
    with httpx.Client(timeout=120) as client:
        for i in range(users):
            client.post(
                url + "/v1/completions",
                json={
                    "model": model,
                    "prompt": "hi",
                    "max_tokens": 1,
                    "vllm_xargs": {"output_rate_user": f"tenant-{offset + i}"},
                },
            ).raise_for_status()


def _scrape(url: str) -> tuple[float, int, int, int]:
    """Median seconds, bytes, lines of ours, distinct user labels."""
    times, body = [], ""
    with httpx.Client(timeout=120) as client:
        for _ in range(SCRAPES):
            began = time.perf_counter()
            body = client.get(url + "/metrics").text
            times.append(time.perf_counter() - began)
    ours = [line for line in body.splitlines() if line.startswith("vllm:output_rate_")]
    labels = {
        line.split('user="', 1)[1].split('"', 1)[0] for line in ours if 'user="' in line
    }
    return statistics.median(times), len(body.encode()), len(ours), len(labels)


def _stats_pass(url: str) -> tuple[float, int]:
    """Seconds for every page of the admin stats endpoint, and its users."""
    began, after, users = time.perf_counter(), None, 0
    with httpx.Client(timeout=120) as client:
        while True:
            params = {"limit": "1000", **({"after": after} if after else {})}
            page = client.get(
                url + "/v1/output_rate/stats",
                params=params,
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            ).json()
            users += len(page["users"])
            after = page["next"]
            if after is None:
                return time.perf_counter() - began, users


def metrics_scrape(quick: bool = False) -> dict[str, Any]:
    model = str(build_tiny_model())
    args = ["--default-user-output-tokens-per-second", "50"]
    env = {
        "VLLM_PLUGINS": "output_rate,output_rate_http",
        "VLLM_OUTPUT_RATE_ADMIN_KEY": ADMIN_KEY,
    }
    rows: list[dict[str, Any]] = []
    with running_server(model, args, env=env, start_timeout_s=600) as url:
        configured = 0
        for step, size in enumerate(QUICK_SIZES if quick else SIZES):
            put_s = _configure_users(url, configured, size)
            configured = size
            _traffic(url, model, DISTINCT_USERS, offset=step * DISTINCT_USERS)
            time.sleep(2.5)  # the API server polls the engine once a second
            seconds, size_bytes, lines, labels = _scrape(url)
            stats_s, stats_users = _stats_pass(url)
            rows.append(
                {
                    "configured_users": size,
                    "users_with_traffic": stats_users,
                    "scrape_s": seconds,
                    "scrape_bytes": size_bytes,
                    "our_lines": lines,
                    "user_labels": labels,
                    "stats_pass_s": stats_s,
                    "configure_s": put_s,
                }
            )
    base = rows[0]["scrape_s"]
    for row in rows:
        row["scrape_ratio"] = row["scrape_s"] / base
    ratio = rows[-1]["scrape_ratio"]
    return {
        "quick": quick,
        "rows": rows,
        "distinct_users": DISTINCT_USERS,
        "scrapes": SCRAPES,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
    }


def metrics_scrape_bench(pool: object, quick: bool) -> dict[str, Any]:
    """For ``python -m benchmarks``: it starts its own server, not the pool's."""
    return metrics_scrape(quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10^3 and 10^5 only")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = metrics_scrape(args.quick)
    from benchmarks.report.metrics_scrape import table

    print("\n".join(table(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
