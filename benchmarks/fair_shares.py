"""9. Fair shares on a saturated engine, ours against stock vLLM side by side.

Issue 16: when the engine itself is the bottleneck (here
``--max-num-active-seqs 3``, limits far above demand), who gets its tokens?
Stock vLLM serves in queue order; ours by weighted service (weights, floors).
Two servers with the same engine flags run at once (stock: no plugin; ours:
weights and a floor, ``WEIGHTS`` and ``FLOORS``), and the same load runs on
each in turn, ``rounds`` times (stock, ours, stock, ours...). Scenarios:

* ``weights``: ``many`` (weight 1, 16 streams) beside ``light`` (weight 2, 2
  streams): ours should give light : many = 2 : 1 in tokens;
* ``equal``: two users of 16 streams each (the issue's measurement: stock
  gave 0.56 : 1); ours should give 1 : 1;
* ``floor``: ``hog`` (weight 20, 32 streams) beside ``floored`` (floor 60
  tok/s, 2 streams): by weight alone floored would get 1/21 of the engine.

Ours' shares are judged at the engine, from its dispatch log over the same
window (vLLM's API server on this 2-core machine delivered tokens up to
20 s late in the 21:24 run, and a stream's share at the client is then the
front end's, not the scheduler's); stock has no dispatch log and is shown
at the client. Figures per scenario and server, from the load tool's own
records (the client's token counts) over the window from ``WARM_S`` after
the start to the load's end: each user's tokens/s and share, TTFT p50/p95 of its
streams (4,000-token requests, so TTFT is mostly how long a stream that
opens on a full engine waits for its first token), and the total tokens/s;
ours / stock total in the same round. The servers' throughput on this
2-core machine swings with vLLM's HTTP front end (BENCHMARKS.md's note on
the slow state), so total throughput is judged on the engine without HTTP,
as in section 1b
(``engine_throughput`` with the same engine settings and policy: batches
of 36 requests of two users, paired rounds; a batch that ends leaves a few
steps with fewer requests than slots, more so on ours, whose requests all
progress together: 36 requests make that tail about 1 % of a batch).
Then ``batch_changes``: how often each scheduler's batch changes on the
engine load (scheduler level, deterministic), and ``fair_share_cost``: the
scheduler step when the ranking runs, at
R = 4,096 with U = 256 and 10,000 (no server).

Usage::

    PYTHONPATH=tests:. python -m benchmarks.fair_shares [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.progress import log
from harness.bounds import S as NS_PER_S
from harness.shares import served_window

WEIGHTS = {"light": 2.0, "hog": 20.0}
FLOORS = {"floored": 60.0}
FAR_LIMIT = 100_000.0  # tok/s: never binds here
# The same policy for the engine without HTTP (benchmarks.engine_throughput's
# saturated kinds): additional_config and LLM arguments, and its load (36
# requests of two users, 64 tokens each, 2 batches a round).
FAIRNESS_CONFIG = {
    "user_output_weight": WEIGHTS,
    "user_min_output_tokens_per_second": FLOORS,
}
ENGINE_LIMITS = {"max_num_seqs": 40, "max_num_active_seqs": 3}
ENGINE_ARGS = ["--max-model-len", "4096"] + [
    arg
    for name, value in ENGINE_LIMITS.items()
    for arg in ("--" + name.replace("_", "-"), str(value))
]
ENGINE_LOAD_USERS = ("even-a", "even-b") * 18
SCENARIOS: dict[str, dict[str, int]] = {
    "weights": {"many": 16, "light": 2},
    "equal": {"even-a": 16, "even-b": 16},
    "floor": {"hog": 32, "floored": 2},
}
# The share each scenario's second user should get on ours (None: a floor).
EXPECTED_SHARE = {"weights": 2 / 3, "equal": 1 / 2, "floor": None}
# Requests longer than a load: every user stays backlogged (a user whose
# streams wait on the client between requests is not owed the share it
# leaves unused; with 100-token requests light's two streams idled on HTTP
# round trips long enough to cap it near a fifth of the engine, and with
# 3,500-token ones in 20 s loads light's requests ended at the engine and
# the next reached it seconds later: 0.587 in the 15:42 run's first round,
# 0.664 in its second). A stream gets at most one token a step, and steps
# run at about 200 a second here (250 would be fast), so 4,000 tokens (what
# --max-model-len 4096 leaves beside the prompt) outlast a 16 s load; every
# request still running is cut when the load ends (request_timeout_s).
MAX_TOKENS = 4000
WARM_S = 5.0
FULL_S, QUICK_S = 16.0, 10.0
FULL_ROUNDS, QUICK_ROUNDS = 2, 1


def ours_args() -> list[str]:
    return [
        *ENGINE_ARGS,
        "--default-user-output-tokens-per-second",
        f"{FAR_LIMIT:g}",
        "--user-output-weight",
        json.dumps(WEIGHTS),
        "--user-min-output-tokens-per-second",
        json.dumps(FLOORS),
    ]


def window_figures(records: list[Any], users: list[str], end_s: float) -> dict:
    """Per-user tokens/s, share and TTFT, and the total, over ``[WARM_S,
    end_s]`` of one load run's records (``loadtest.RequestRecord``)."""
    from vllm_output_rate.loadtest.summary import percentile

    span = end_s - WARM_S
    tokens = {
        user: sum(
            n
            for r in records
            if r.user == user
            for t, n in r.chunks
            if WARM_S <= t <= end_s
        )
        for user in users
    }
    total = sum(tokens.values())
    figures: dict[str, Any] = {"window_s": span, "total_tok_s": total / span}
    for user in users:
        ttfts = [
            r.ttft_s * 1000 for r in records if r.user == user and r.ttft_s is not None
        ]
        figures[user] = {
            "tok_s": tokens[user] / span,
            "share": tokens[user] / total if total else None,
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p95_ms": percentile(ttfts, 95),
            "requests": len(ttfts),
        }
    return figures


def engine_figures(
    dispatched: dict[str, list[int]], users: list[str], start_ns: int, end_ns: int
) -> dict[str, Any]:
    """Per-user tokens/s and share at the engine (its dispatch log) over the
    part of ``[start_ns, end_ns]`` in which every user was served
    (``harness.shares.served_window``): light's requests can end
    at the engine seconds before the client sees their last token and sends
    the next, and light is not owed a share while it has nothing to run (the
    14:34 run: both ended 17.7 s into the load, 2 tokens in each of their
    3,505 steps, and its share over the whole window read 0.55). Each user's
    longest gap is over the whole window."""
    begin_ns, judged_end_ns = served_window(dispatched, users, start_ns, end_ns, 0)
    if judged_end_ns <= begin_ns:  # never served together: judge it all
        begin_ns, judged_end_ns = start_ns, end_ns
    span_s = max(judged_end_ns - begin_ns, 1) / NS_PER_S
    tokens = {
        user: sum(begin_ns <= t <= judged_end_ns for t in dispatched.get(user, ()))
        for user in users
    }
    total = sum(tokens.values())
    figures: dict[str, Any] = {
        user: {
            "tok_s": tokens[user] / span_s,
            "share": tokens[user] / total if total else None,
            "longest_gap_s": longest_gap_s(dispatched.get(user, ()), start_ns, end_ns),
        }
        for user in users
    }
    figures["window_s"] = span_s
    return figures


def longest_gap_s(times_ns: Iterable[int], start_ns: int, end_ns: int) -> float:
    """The longest time within ``[start_ns, end_ns]`` in which the engine
    dispatched none of a user's tokens (window edges included): a user that
    got nothing for seconds is told apart from one served slowly."""
    inside = sorted(t for t in times_ns if start_ns <= t <= end_ns)
    edges = [start_ns, *inside, end_ns]
    return max(b - a for a, b in itertools.pairwise(edges)) / NS_PER_S


def request_timeline(records: list[Any], user: str) -> list[dict[str, Any]]:
    """A user's requests as the client saw them (seconds since the load's
    start): when each was sent, its first token, its end and its tokens.
    Beside the engine's gaps, it tells a request that reached the engine
    late (sent, no first token for seconds, no dispatch) from one the
    scheduler held."""
    return [
        {
            "sent_s": r.start_s,
            "first_token_s": r.first_token_s,
            "end_s": r.end_s,
            "tokens": r.tokens,
        }
        for r in sorted(records, key=lambda r: r.start_s)
        if r.user == user
    ]


def judged_user(streams: dict[str, int]) -> str | None:
    """The user whose share a scenario judges: the second (light, floored,
    even-b). The one-user warm-up load judges nobody."""
    users = list(streams)
    return users[1] if len(users) > 1 else None


def opening_order(streams: dict[str, int]) -> list[str]:
    """The users in the order their streams open: the judged user first. The
    load tool opens streams in its list's order, and with both servers busy
    on 2 cores the last of 34 connections can wait more than the client's
    10 s connect timeout (the 15:09 run: floored's two streams, opened last
    beside 32 of hog's, failed with ConnectTimeout and never reached the
    engine, so its floor read 0)."""
    judged = judged_user(streams)
    return [judged, *(u for u in streams if u != judged)] if judged else list(streams)


def _run_load(
    url: str,
    model: str,
    streams: dict[str, int],
    seconds: float,
    dispatch_log: Path | None = None,
) -> dict:
    """One load; with ``dispatch_log`` (ours), the shares at the engine too."""
    from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync
    from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

    spec = LoadSpec(
        base_url=url,
        model=model,
        users=[UserLoad(user, streams[user]) for user in opening_order(streams)],
        prompt="fair shares on a full engine",
        max_tokens=MAX_TOKENS,
        duration_s=seconds,
        request_timeout_s=seconds,
    )
    started_ns = time.monotonic_ns()
    result = run_load_sync(spec)
    figures = window_figures(result.records, list(streams), seconds)
    judged = judged_user(streams)
    if judged is not None:  # keep its requests for a post-mortem of a miss
        figures["timeline"] = request_timeline(result.records, judged)
    if dispatch_log is not None:
        time.sleep(1.5)  # the log is written a second behind the engine
        figures["engine"] = engine_figures(
            read_dispatch_log(str(dispatch_log)),
            list(streams),
            started_ns + int(WARM_S * NS_PER_S),
            started_ns + int(seconds * NS_PER_S),
        )
    # Requests cut when the load ends are expected ("timed out"); any other
    # failure (seen once: stock's API server not accepting a connection
    # within 10 s) is counted and shown, and fails ours' verdicts.
    failed = [r for r in result.records if r.error and "timed out" not in r.error]
    if failed:
        # Only the counted ones: the load's own cuts would crowd them out.
        summary = result.error_summary(failed=failed)
        log("fair shares: failed requests: " + "; ".join(summary))
    figures["failed"] = len(failed)
    return figures


def _wait_until_idle(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the server holds no request: a stream cut at the end of a
    load leaves its request in vLLM's queue until vLLM writes to it (stock's
    queued requests are written to only once they run)."""
    from benchmarks.measure import metric_totals

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        totals = metric_totals(url)
        held = sum(
            totals.get(f"vllm:num_requests_{q}", 0.0) for q in ("running", "waiting")
        )
        if held == 0:
            return
        time.sleep(0.5)


def servers(model: str, quick: bool, work_dir: Path) -> dict[str, Any]:
    """Every scenario on both servers, in alternating rounds."""
    from vllm_output_rate.demo.server import running_server
    from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV

    dispatch_log = work_dir / "ours-dispatch.csv"

    seconds = QUICK_S if quick else FULL_S
    rounds = QUICK_ROUNDS if quick else FULL_ROUNDS
    runs: list[dict[str, Any]] = []
    with (
        running_server(
            model, ENGINE_ARGS, env={"VLLM_PLUGINS": ""}, log_dir=work_dir / "stock"
        ) as stock_url,
        running_server(
            model,
            ours_args(),
            env={DISPATCH_LOG_ENV: str(dispatch_log)},
            log_dir=work_dir / "ours",
        ) as ours_url,
    ):
        urls = {"stock": stock_url, "ours": ours_url}
        for url in urls.values():  # warm-up: the first requests are slow
            _run_load(url, model, {"warm-up": 2}, WARM_S + 1)
        for round_ in range(rounds):
            for scenario, streams in SCENARIOS.items():
                for server, url in urls.items():
                    log(f"fair shares: {scenario} on {server}, round {round_ + 1}")
                    _wait_until_idle(url)
                    figures = _run_load(
                        url,
                        model,
                        streams,
                        seconds,
                        dispatch_log if server == "ours" else None,
                    )
                    runs.append(
                        {
                            "scenario": scenario,
                            "server": server,
                            "round": round_,
                            **figures,
                        }
                    )
    return {"runs": runs, "summary": summarize(runs), "max_tokens": MAX_TOKENS}


def judged(run: dict[str, Any], user: str) -> dict[str, Any]:
    """A user's figures as judged: at the engine where its dispatch log was
    read (ours), else at the client (stock)."""
    return run["engine"][user] if "engine" in run else run[user]


def median_known(values: Iterable[float | None]) -> float | None:
    """The median of the values known. A share is None in a round where
    nobody got a token in the window (the 14:52 run: a server's front end
    that delivered nothing for 15 s); None if no round has one."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario and server: medians over rounds of the second user's
    share (and tok/s), as judged, and of ours / stock total tok/s at the
    client paired by round."""
    summary: dict[str, Any] = {}
    for scenario, streams in SCENARIOS.items():
        second = list(streams)[1]
        rows = {
            server: sorted(
                (
                    r
                    for r in runs
                    if r["scenario"] == scenario and r["server"] == server
                ),
                key=lambda r: r["round"],
            )
            for server in ("stock", "ours")
        }
        pairs = list(zip(rows["stock"], rows["ours"], strict=True))
        summary[scenario] = {
            "user": second,
            # Rounds in which stock's server delivered nothing in the window
            # (its HTTP slow state) have no ratio.
            "throughput_ratio": median_known(
                o["total_tok_s"] / s["total_tok_s"] if s["total_tok_s"] else None
                for s, o in pairs
            ),
            **{
                server: {
                    "share": median_known(
                        judged(r, second)["share"] for r in rows[server]
                    ),
                    "tok_s": statistics.median(
                        judged(r, second)["tok_s"] for r in rows[server]
                    ),
                    "failed": sum(r.get("failed", 0) for r in rows[server]),
                }
                for server in rows
            },
        }
    return summary


def run(quick: bool, work_dir: Path) -> dict[str, Any]:
    """For ``make bench`` (``benchmarks.suite``): the saturated load on both
    servers, the engine's throughput without HTTP, how often each engine's
    batch changes, then the ranking's step cost."""
    from benchmarks import batch_changes, fair_share_cost
    from benchmarks.engine_throughput import SATURATED_KINDS, engine_throughput
    from vllm_output_rate.demo.tiny_model import build_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model())
    results: dict[str, Any] = {"servers": servers(model, quick, work_dir)}
    engine_dir = work_dir / "engine"
    engine_dir.mkdir(exist_ok=True)
    results["engine"] = engine_throughput(
        model, engine_dir, settle=lambda: 0.0, quick=quick, kinds=SATURATED_KINDS
    )
    results["batch_changes"] = batch_changes.run(model)
    requests = 1024 if quick else 4096
    rounds = 10 if quick else 30
    results["cost"] = {
        "requests": requests,
        "rounds": rounds,
        "subjects": fair_share_cost.run(requests, rounds),
    }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fair_shares")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-fair-shares-"))
    results = run(args.quick, work_dir)
    from benchmarks.report.fair_shares import table

    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
