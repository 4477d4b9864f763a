"""The noisy-neighbour demo: the same load on stock vLLM, then with limits.

``make demo`` (or ``vllm-output-rate demo``) builds the tiny local model if
needed, starts a real vLLM OpenAI server on 127.0.0.1 twice, drives the same
multi-user streaming load against each, prints a table per run and writes a
chart of every user's tokens per second, before and after. Servers are always
shut down, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model
from vllm_output_rate.loadtest import CAVEAT, LoadResult, LoadSpec, UserLoad
from vllm_output_rate.loadtest import run_load_sync as run_load

# user name (None: anonymous), streams, limit in tok/s
DEMO_USERS: list[tuple[str | None, int, float]] = [
    ("user-a", 4, 20),
    ("user-b", 1, 100),
    ("user-c", 8, 200),  # the noisy neighbour: many streams
    (None, 1, 50),  # no output_rate_user: the shared anonymous budget
]
DEFAULT_LIMIT = 50
SERVER_ARGS = ["--max-num-seqs", "32", "--max-num-active-seqs", "16"]


def limit_flags() -> list[str]:
    named = {name: limit for name, _, limit in DEMO_USERS if name is not None}
    return [
        "--default-user-output-tokens-per-second",
        str(DEFAULT_LIMIT),
        "--user-output-tokens-per-second",
        json.dumps(named),
    ]


def run_once(
    model: str, flags: list[str], duration_s: float, max_tokens: int, limited: bool
) -> LoadResult:
    users = [
        UserLoad(name, streams, limit if limited else None)
        for name, streams, limit in DEMO_USERS
    ]
    label = "with per-user limits" if limited else "stock vLLM, no limits"
    print(f"\n== {label}: starting the server ...", flush=True)
    with running_server(model, SERVER_ARGS + flags) as url:
        print(f"== {label}: {duration_s:g} s of load at {url}", flush=True)
        spec = LoadSpec(
            base_url=url,
            model=model,
            users=users,
            max_tokens=max_tokens,
            duration_s=duration_s,
        )
        return run_load(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-output-rate demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=20, help="seconds per run")
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="folder for outputs"
    )


def run(args: argparse.Namespace) -> int:
    from vllm_output_rate.loadtest.report import format_table, plot_rates

    model = str(build_tiny_model())
    print(f"model: {model} (tiny random-weight Llama, built locally)")
    try:
        stock = run_once(model, [], args.duration, args.max_tokens, limited=False)
        limited = run_once(
            model, limit_flags(), args.duration, args.max_tokens, limited=True
        )
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped", file=sys.stderr)
        return 130
    print()
    print(format_table(stock, title="Stock vLLM (no limits)"))
    print()
    print(format_table(limited, title="With vllm-output-rate"))
    print()
    print(CAVEAT)
    args.out.mkdir(parents=True, exist_ok=True)
    stock.write_json(args.out / "stock.json")
    limited.write_json(args.out / "limited.json")
    chart = plot_rates(
        {"stock vLLM": stock, "with per-user limits": limited},
        args.out / "demo.png",
        title="Output tokens per second per user: noisy neighbour before and after",
    )
    print(f"\nwrote {chart} and the raw results in {args.out}/")
    problems = [
        f"{u.label}: bound exceeded" for u in limited.users if u.bound_ok is False
    ] + [
        f"{len(r.failed_requests)} failed requests"
        for r in (stock, limited)
        if not r.ok
    ]
    for problem in problems:
        print(f"demo: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
