"""What one run of a scene measured, per user, at the engine and at the client.

``run_figures`` turns a run's load results (one ``LoadResult`` per user) and,
with limits, the plugin's stats readings into one ``UserFigures`` per user
(pure: tested without a server):

* time to first token, p50 over the user's requests: at the client (request
  sent to first token received) and at the engine (request queued to first
  token sampled: vLLM's per-request ``queue_time_ms`` plus
  ``time_to_first_token_ms``, on stock and with limits alike);
* rate: for the light user, tokens per second of request time (sent to last
  token at the client; queued to last token at the engine); for the others,
  tokens per second over the run's window (client: tokens received in it;
  engine: the plugin's counts, so with limits only);
* the requests: completed, refused by design (a 429 to a refusable user),
  refused by stock vLLM's full queue (a 503 on stock: what a scene about
  the queue shows) and failed (anything else, with the error texts);
* the share of the requests answered (completed of all sent).

Only requests that ended within the run's window count towards the light
user's figures: after it, the demo lifts the limits to drain (``run.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_output_rate.demo.engine_tally import EngineTally
from vllm_output_rate.demo.engine_view import EngineWatch
from vllm_output_rate.demo.scenes import DemoUser, Role, Scene
from vllm_output_rate.loadtest import LoadResult, RequestRecord
from vllm_output_rate.loadtest.summary import percentile

TOO_MANY_REQUESTS = 429
SERVICE_UNAVAILABLE = 503


@dataclass
class Outcomes:
    ok: int = 0
    refused: int = 0  # 429s to a refusable user: its own excess, by design
    failed: list[str] = field(default_factory=list)  # one error text each
    queue_full: int = 0  # 503s on stock vLLM: its queue caps, full

    @property
    def sent(self) -> int:
        return self.ok + self.refused + self.queue_full + len(self.failed)

    @property
    def answered_share(self) -> float | None:
        return self.ok / self.sent if self.sent else None


@dataclass
class UserFigures:
    name: str
    role: Role
    limit: float | None  # tok/s; None on stock vLLM
    outcomes: Outcomes
    ttft_engine_s: float | None = None  # p50
    ttft_client_s: float | None = None  # p50
    rate_engine: float | None = None  # tok/s, see the module docstring
    rate_client: float | None = None
    bound_held: bool | None = None  # at the engine; with limits only
    # p50 of the client's TTFT less the engine's: the time a request spent
    # in the HTTP front end (both ways) and the client.
    outside_engine_s: float | None = None
    # p50 of the time a request waited in the engine's queue: a scene's
    # scarcity shows here (a hog that did not fill the queue says why its
    # light user was not hurt).
    queued_engine_s: float | None = None


@dataclass
class RunFigures:
    limited: bool
    users: dict[str, UserFigures]
    others_cores: float | None = None  # the CPU others took meanwhile (busy.py)
    others_share: float | None = None
    # The share of the light user's window the others' requests covered
    # (overlap.py); None when it could not be told.
    covered: float | None = None
    tally: EngineTally | None = None  # what the engine did (engine_tally.py)


@dataclass
class EngineView:
    """With limits: the plugin's stats readings and the run's window on the
    engine's clock (``time.monotonic()``, the demo's clock too)."""

    watch: EngineWatch
    start_s: float
    end_s: float


def outcomes(user: DemoUser, records: list[RequestRecord], limited: bool) -> Outcomes:
    out = Outcomes()
    for r in records:
        if r.ok:
            out.ok += 1
        elif user.refusable and r.refusal_status == TOO_MANY_REQUESTS:
            out.refused += 1
        elif not limited and r.refusal_status == SERVICE_UNAVAILABLE:
            out.queue_full += 1
        else:
            out.failed.append(r.error or f"HTTP {r.status}")
    return out


def engine_queue_s(r: RequestRecord) -> float | None:
    """Arrival to scheduled, at the engine."""
    queue = (r.engine_metrics or {}).get("queue_time_ms")
    return queue / 1000.0 if isinstance(queue, (int, float)) else None


def engine_ttft_s(r: RequestRecord) -> float | None:
    m = r.engine_metrics or {}
    queue, first = m.get("queue_time_ms"), m.get("time_to_first_token_ms")
    if not isinstance(queue, (int, float)) or not isinstance(first, (int, float)):
        return None
    return (queue + first) / 1000.0


def engine_time_s(r: RequestRecord) -> float | None:
    """Queued to last token, at the engine (generation_time_ms is absent or
    0 for a one-token answer)."""
    first = engine_ttft_s(r)
    generation = (r.engine_metrics or {}).get("generation_time_ms") or 0.0
    if first is None or not isinstance(generation, (int, float)):
        return None
    return first + generation / 1000.0


def outside_engine_s(records: list[RequestRecord]) -> float | None:
    return _median(
        [
            r.ttft_s - engine
            for r in records
            if r.ok
            and r.ttft_s is not None
            and (engine := engine_ttft_s(r)) is not None
        ]
    )


def queued_engine_s(records: list[RequestRecord]) -> float | None:
    return _median(
        [queue for r in records if r.ok and (queue := engine_queue_s(r)) is not None]
    )


def _median(values: list[float]) -> float | None:
    return percentile(values, 50)


def _per_request_rate(tokens_and_times: list[tuple[int, float]]) -> float | None:
    time_s = sum(t for _, t in tokens_and_times)
    return sum(n for n, _ in tokens_and_times) / time_s if time_s > 0 else None


def light_figures(fig: UserFigures, result: LoadResult) -> None:
    """TTFT and per-request rate over the completed requests of the window."""
    done = [r for r in result.records if r.ok and r.chunks]
    inside = [r for r in done if (r.end_s or 0) <= result.spec.duration_s]
    chosen = inside or done
    fig.ttft_client_s = _median([r.ttft_s for r in chosen if r.ttft_s is not None])
    fig.ttft_engine_s = _median(
        [t for r in chosen if (t := engine_ttft_s(r)) is not None]
    )
    fig.rate_client = _per_request_rate(
        [(r.tokens, r.chunks[-1][0] - r.start_s) for r in chosen]
    )
    fig.rate_engine = _per_request_rate(
        [(r.tokens, t) for r in chosen if (t := engine_time_s(r)) is not None]
    )


def window_figures(
    fig: UserFigures,
    user: DemoUser,
    result: LoadResult,
    engine: EngineView | None,
) -> None:
    """Rate over the window; with limits, the engine's count and bound."""
    duration = result.spec.duration_s
    tokens = sum(n for r in result.records for t, n in r.chunks if t <= duration)
    fig.rate_client = tokens / duration
    ttfts = [r.ttft_s for r in result.records if r.ttft_s is not None]
    fig.ttft_client_s = _median(ttfts)
    if engine is not None:
        start = engine.start_s + user.start_after_s
        fig.rate_engine = engine.watch.rate(user.name, start, engine.end_s)


def run_figures(
    scene: Scene,
    results: Mapping[str, LoadResult],
    engine: EngineView | None,
) -> RunFigures:
    """Every user's figures in one run (``engine``: with limits only)."""
    users = {}
    for user in scene.users:
        result = results[user.name]
        fig = UserFigures(
            name=user.name,
            role=user.role,
            limit=scene.limit(user) if engine is not None else None,
            outcomes=outcomes(user, result.records, limited=engine is not None),
        )
        if user.role == "light":
            light_figures(fig, result)
        else:
            window_figures(fig, user, result, engine)
        fig.outside_engine_s = outside_engine_s(result.records)
        fig.queued_engine_s = queued_engine_s(result.records)
        if engine is not None and fig.limit is not None:
            fig.bound_held = engine.watch.bound_held(
                user.name, fig.limit, until_s=engine.end_s
            )
        users[user.name] = fig
    return RunFigures(limited=engine is not None, users=users)
