"""Issue 16 on a real server: weights and a floor when the engine is full.

One module-scoped server (``--max-num-active-seqs 3``, limits far above
demand, so the engine itself is the bottleneck), two scenarios one after the
other, driven by the official OpenAI client; each stream is one request of
4,000 tokens (not streamed: less work per token in the API server), closed
when the scenario ends. In the first scenario the many-stream user's streams
are opened first and the other user's only once they are all in the engine
(with ``--enable-log-requests`` the API server logs each request it hands
over): on a loaded 2-core machine handing 16 streams over can take longer
than the other user's two streams need to finish. Shares are judged at the
engine, from the scheduler's dispatch log, over each scenario's window: from
when every stream is in the engine to its end, or to the last token of the
user served last if that came first (a user whose requests ended is not
backlogged). Each scenario holds its streams for 12 s after they are all in.
The machine's speed does not matter, only who got the engine's tokens.

1. ``many`` (weight 1, 16 streams) beside ``light`` (weight 2, 2 streams):
   2 : 1 in tokens within 10 % (by streams it would be 1 : 8).
2. ``hog`` (weight 20, 32 streams) beside ``floored`` (floor 60 tok/s, 2
   streams): by weight alone ``floored`` would get 1/21 of the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from harness.bounds import S
from harness.shares import served_window
from vllm_output_rate.demo.server import RunningServer, running_server
from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV
from vllm_output_rate.scheduling.dispatch_log import read_dispatch_log

pytestmark = pytest.mark.e2e

FLOOR = 60.0
SCENARIO_S = 12.0
ADMISSION_TIMEOUT_S = 300.0
ADDED = b"Added request "  # vLLM's line per request, --enable-log-requests
ARGS = [
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "40",
    "--max-num-active-seqs",
    "3",
    "--default-user-output-tokens-per-second",
    "100000",
    "--user-output-weight",
    json.dumps({"light": 2, "hog": 20}),
    "--user-min-output-tokens-per-second",
    json.dumps({"floored": FLOOR}),
    "--enable-log-requests",
]


async def stream(client: AsyncOpenAI, model: str, user: str) -> None:
    # Not streamed: the API server then does little per token, and hands a
    # new request over promptly even on a loaded machine. The scenario
    # cancels it (vLLM aborts a request whose client left).
    await client.completions.create(
        model=model,
        prompt="fair shares",
        max_tokens=4000,
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": user}},
    )


async def when_all_added(server: RunningServer, since: int, count: int) -> int:
    """When (monotonic ns) the API server had handed ``count`` requests to
    the engine since offset ``since`` of its log. Read from the log: while
    streams run, this machine's API server can leave /metrics unanswered for
    as long as they last."""
    give_up = time.monotonic() + ADMISSION_TIMEOUT_S
    added = 0
    while time.monotonic() < give_up:
        with open(server.log_path, "rb") as log:
            log.seek(since)
            added = log.read().count(ADDED)
        if added >= count:
            return time.monotonic_ns()
        await asyncio.sleep(0.2)
    raise AssertionError(f"{added} of {count} requests in the engine")


async def run_scenario(
    server: RunningServer, model: str, groups: list[dict[str, int]]
) -> tuple[int, int]:
    """Open each group's streams (user -> count) in turn, each group's once
    the ones before are all in the engine; hold them for the scenario once
    all are in, close them; return the window (monotonic ns, the engine's
    clock too) to judge. It starts when every stream is in or, with several
    groups, when the last group is opened: the log that says its streams are
    in can come late on a loaded machine, after they were served (the
    judge's window then starts a second after their first token)."""
    since = server.log_path.stat().st_size
    client = AsyncOpenAI(
        base_url=server + "/v1", api_key="unused", timeout=600, max_retries=0
    )
    tasks: list[asyncio.Task[None]] = []
    try:
        for group in groups:
            opened = time.monotonic_ns()
            tasks += [
                asyncio.create_task(stream(client, model, user))
                for user, count in group.items()
                for _ in range(count)
            ]
            started = await when_all_added(server, since, len(tasks))
        if len(groups) > 1:
            started = opened
        await asyncio.sleep(SCENARIO_S)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    ended = time.monotonic_ns()
    await asyncio.sleep(1.0)  # aborted streams leave the engine
    return started, ended - S // 2


@dataclass
class Share:
    tokens: dict[str, int]
    window_s: float


def share(dispatched: dict[str, list[int]], users: list[str], start: int, end: int):
    """Tokens per user from 1 s after every user was served until ``end``."""
    times = {u: [t for t in dispatched.get(u, []) if start <= t <= end] for u in users}
    assert all(times.values()), {  # tokens in the window, and in all
        u: (len(t), len(dispatched.get(u, []))) for u, t in times.items()
    }
    # Only while every user is served: in CI a 12 s scenario lasted minutes
    # (the client's loop stalled, not the engine), long enough for light's
    # requests to end, and after that many had the engine alone.
    begin, end = served_window(times, users, start, end)
    assert end - begin >= 4 * S, (end - begin) / S  # a window worth judging
    counts = {u: sum(begin <= t <= end for t in ts) for u, ts in times.items()}
    return Share(counts, (end - begin) / S)


@pytest.fixture(scope="module")
def shares(tiny_model_path: str, tmp_path_factory) -> dict[str, Share]:
    log = Path(tmp_path_factory.mktemp("fair")) / "dispatch.csv"
    env = {"VLLM_PLUGINS": "output_rate,output_rate_http", DISPATCH_LOG_ENV: str(log)}
    with running_server(tiny_model_path, ARGS, env=env) as server:
        weighted = asyncio.run(
            run_scenario(server, tiny_model_path, [{"many": 16}, {"light": 2}])
        )
        # Together: with the floored user's two opened once the hog's 32
        # were in, the engine once dispatched nothing for the rest of the
        # scenario (seen twice on a loaded machine, before the kept batch
        # with late outputs was dropped; not seen since in three runs of the
        # two groups in turn, one beside two busy CPU loops). On a loaded
        # machine the API server hands 32 streams over in tens of seconds
        # (38 s there) while the hog's first requests run: opened together,
        # both users are in the engine for the whole window.
        floored = asyncio.run(
            run_scenario(server, tiny_model_path, [{"hog": 32, "floored": 2}])
        )
        time.sleep(1.5)  # the log is written a second behind the engine
        dispatched = read_dispatch_log(str(log))
    return {
        "weighted": share(dispatched, ["many", "light"], *weighted),
        "floored": share(dispatched, ["hog", "floored"], *floored),
    }


def test_two_to_one_weights_get_two_to_one_tokens(shares) -> None:
    got = shares["weighted"].tokens
    assert got["many"] > 100, got  # the window saw real work
    assert 1.8 <= got["light"] / got["many"] <= 2.2, got


def test_a_floored_user_keeps_its_floor_beside_a_32_stream_user(shares) -> None:
    got, window_s = shares["floored"].tokens, shares["floored"].window_s
    assert got["floored"] >= 0.9 * FLOOR * window_s, (got, window_s)
    # Not much more: beyond its floor it has its weight's share (1/21).
    total = got["floored"] + got["hog"]
    assert got["floored"] <= max(1.2 * FLOOR * window_s, total / 21 * 1.3), got
