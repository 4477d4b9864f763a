"""The noisy-neighbour demo: the same load on stock vLLM, then with limits.

``make demo`` (or ``vllm-output-rate demo``) builds the tiny local model if
needed, starts a real vLLM OpenAI server on 127.0.0.1 twice, drives the same
multi-user streaming load against each, and prints a table per run. For the
limited run it also shows what the engine did, as an operator would see it:
each user's rate from the plugin's stats endpoint, read every half second
while the load runs (exact engine counts, no HTTP buffering), and the
engine-side time to first token from its metrics; the bound is judged on
those counts. The chart (``demo.png``) puts both side by side with the limits
drawn. Servers are always shut down, Ctrl-C included. Exit code 1 only for
failed requests or a bound the engine broke.
"""

from __future__ import annotations

import argparse
import io
import json
import secrets
import sys
import time
from pathlib import Path

import httpx
from rich import box
from rich.console import Console
from rich.table import Table

from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.demo.engine_view import EngineWatch, first_token_quantiles
from vllm_output_rate.demo.server import running_server
from vllm_output_rate.demo.tiny_model import build_tiny_model
from vllm_output_rate.loadtest import CAVEAT, LoadResult, LoadSpec, UserLoad
from vllm_output_rate.loadtest import run_load_sync as run_load

# user name (None: anonymous), streams, limit in tok/s
DEMO_USERS: list[tuple[str | None, int, float]] = [
    ("user-a", 4, 20),  # a heavy user, capped low
    ("user-b", 1, 1000),  # a light user: one stream, far below its limit
    ("user-c", 8, 200),  # the noisy neighbour: many streams
    (None, 1, 50),  # no output_rate_user: the shared anonymous budget
]
DEFAULT_LIMIT = 50
SERVER_ARGS = ["--max-num-seqs", "32", "--max-num-active-seqs", "16"]
# A first start on a cold, busy machine has taken over 2 minutes.
START_TIMEOUT_S = 600.0


def engine_name(user: str | None) -> str:
    return ANONYMOUS_USER if user is None else user


def limit_flags() -> list[str]:
    named = {name: limit for name, _, limit in DEMO_USERS if name is not None}
    return [
        "--default-user-output-tokens-per-second",
        str(DEFAULT_LIMIT),
        "--user-output-tokens-per-second",
        json.dumps(named),
    ]


class EngineRun:
    """The limited run's engine-side view (see engine_view.py)."""

    def __init__(self, watch: EngineWatch, start_s: float, metrics: str) -> None:
        self.watch = watch
        self.start_s = start_s
        self.first_token = first_token_quantiles(metrics)


def run_once(
    model: str, flags: list[str], duration_s: float, max_tokens: int, limited: bool
) -> tuple[LoadResult, EngineRun | None]:
    users = [
        UserLoad(name, streams, limit if limited else None)
        for name, streams, limit in DEMO_USERS
    ]
    label = "with per-user limits" if limited else "stock vLLM, no limits"
    admin_key = secrets.token_urlsafe(16)
    env = (
        {
            "VLLM_PLUGINS": "output_rate,output_rate_http",
            "VLLM_OUTPUT_RATE_ADMIN_KEY": admin_key,
        }
        if limited
        else None
    )
    print(f"\n== {label}: starting the server ...", flush=True)
    with running_server(
        model, SERVER_ARGS + flags, env=env, start_timeout_s=START_TIMEOUT_S
    ) as url:
        print(f"== {label}: {duration_s:g} s of load at {url}", flush=True)
        spec = LoadSpec(
            base_url=url,
            model=model,
            users=users,
            max_tokens=max_tokens,
            duration_s=duration_s,
        )
        if not limited:
            return run_load(spec), None
        with EngineWatch(url, admin_key) as watch:
            start_s = time.monotonic()  # the engine's clock too
            result = run_load(spec)
        time.sleep(1.5)  # the metrics are polled from the engine once a second
        metrics = httpx.get(url + "/metrics", timeout=30).text
        return result, EngineRun(watch, start_s, metrics)


def format_engine_table(result: LoadResult, engine: EngineRun) -> str:
    """Per user: what the engine dispatched, beside what the client saw."""
    table = Table(
        title="What the engine did (the plugin's stats and metrics)",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for name in ("user", "limit tok/s", "engine tok/s (load)", "client tok/s"):
        table.add_column(name, justify="left" if name == "user" else "right")
    table.add_column("engine TTFT p50 / p95 ms", justify="right")
    table.add_column("bound held (engine)", justify="center")
    window = (engine.start_s, engine.start_s + result.spec.duration_s)
    for u in result.users:
        name = engine_name(u.name)
        p50, p95 = engine.first_token.get(name, [None, None])
        held = None if u.limit is None else engine.watch.bound_held(name, u.limit)
        table.add_row(
            u.label,
            "none" if u.limit is None else f"{u.limit:g}",
            _num(engine.watch.rate(name, *window)),
            _num(u.rate_tok_s),
            f"{_ms(p50)} / {_ms(p95)}",
            "n.a." if held is None else ("yes" if held else "NO"),
        )
    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:,.0f}"


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
    from vllm_output_rate.demo.chart import plot_demo
    from vllm_output_rate.loadtest.report import format_table

    model = str(build_tiny_model())
    print(f"model: {model} (tiny random-weight Llama, built locally)")
    try:
        stock, _ = run_once(model, [], args.duration, args.max_tokens, limited=False)
        limited, engine = run_once(
            model, limit_flags(), args.duration, args.max_tokens, limited=True
        )
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped", file=sys.stderr)
        return 130
    assert engine is not None
    print()
    print(format_table(stock, title="Stock vLLM (no limits)"))
    print()
    print(format_table(limited, title="With vllm-output-rate (client view)"))
    print()
    print(format_engine_table(limited, engine))
    print()
    print(CAVEAT)
    args.out.mkdir(parents=True, exist_ok=True)
    stock.write_json(args.out / "stock.json")
    limited.write_json(args.out / "limited.json")
    (args.out / "engine.json").write_text(
        json.dumps(
            {
                "start_s": engine.start_s,
                "readings": [vars(r) for r in engine.watch.readings],
                "first_token_p50_p95_s": engine.first_token,
            },
            indent=1,
        )
    )
    chart = plot_demo(
        stock,
        limited,
        engine.watch,
        engine.start_s,
        {u.label: engine_name(u.name) for u in limited.users},
        args.out / "demo.png",
    )
    print(f"\nwrote {chart} and the raw results in {args.out}/")
    problems = [
        f"{u.label}: the engine exceeded the bound"
        for u in limited.users
        if u.limit is not None
        and not engine.watch.bound_held(engine_name(u.name), u.limit)
    ] + [
        f"{len(r.failed_requests)} failed requests: {'; '.join(r.error_summary())}"
        for r in (stock, limited)
        if not r.ok
    ]
    if len(engine.watch.readings) < 2:
        problems.append("the plugin's stats endpoint could not be read")
    for problem in problems:
        print(f"demo: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
