"""What the engine did during a demo run, as an operator's tools see it.

``EngineWatch`` polls the plugin's admin stats endpoint (the same source as
``vllm-output-rate top``) while the load runs: each reading is every user's
cumulative dispatched tokens at the engine's clock, so rates between two
readings are exact engine-side rates, free of HTTP buffering, and the
article's bound can be checked on every pair of readings.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import httpx

STATS_PATH = "/v1/output_rate/stats"
BURST_S = 0.1  # the limiter's burst: the bound is (W + 0.1) * limit + 1


@dataclass
class Reading:
    time_s: float  # the engine's monotonic clock (the client's clock too)
    tokens: dict[str, int]


@dataclass
class EngineWatch:
    """Polls the stats endpoint every ``interval_s`` in a thread."""

    base_url: str
    admin_key: str
    interval_s: float = 0.5
    readings: list[Reading] = field(default_factory=list)
    errors: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.read()  # the final counts

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.read()

    def read(self) -> None:
        try:
            page = httpx.get(
                self.base_url + STATS_PATH,
                params={"limit": 10_000},
                headers={"Authorization": f"Bearer {self.admin_key}"},
                timeout=10,
            ).json()
            tokens = {u: int(v["tokens_admitted"]) for u, v in page["users"].items()}
            self.readings.append(Reading(float(page["time_s"]), tokens))
        except (httpx.HTTPError, ValueError, KeyError):
            self.errors += 1  # a missed reading; the next one covers it

    def series(self, user: str, start_s: float) -> tuple[list[float], list[float]]:
        """(times since ``start_s``, tok/s between consecutive readings)."""
        times, rates = [], []
        for a, b in zip(self.readings, self.readings[1:], strict=False):
            if b.time_s > a.time_s:
                delivered = b.tokens.get(user, 0) - a.tokens.get(user, 0)
                times.append(a.time_s - start_s)
                rates.append(delivered / (b.time_s - a.time_s))
        return times, rates

    def rate(self, user: str, start_s: float, end_s: float) -> float | None:
        """Tokens per second between the first and the last reading within
        [``start_s``, ``end_s``] (the load's window, while demand lasted):
        the engine's count, not the client's."""
        inside = [r for r in self.readings if start_s <= r.time_s <= end_s]
        if len(inside) < 2 or inside[-1].time_s <= inside[0].time_s:
            return None
        tokens = inside[-1].tokens.get(user, 0) - inside[0].tokens.get(user, 0)
        return tokens / (inside[-1].time_s - inside[0].time_s)

    def bound_held(self, user: str, limit: float, until_s: float = math.inf) -> bool:
        """The bound on every pair of readings up to ``until_s`` (while
        ``limit`` was in force): the tokens dispatched between them (a window
        of W seconds) are at most (W + 0.1) x limit + 1."""
        points = [
            (r.time_s, r.tokens.get(user, 0))
            for r in self.readings
            if r.time_s <= until_s
        ]
        for i, (t0, n0) in enumerate(points):
            for t1, n1 in points[i + 1 :]:
                if n1 - n0 > (t1 - t0 + BURST_S) * limit + 1:
                    return False
        return True
