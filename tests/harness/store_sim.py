"""Several engines' leases against one real store, on one fake clock.

Each ``SimEngine`` is what one engine's scheduler does with its budget in a
step (``between_steps``, then one ``take_many`` of the step's demand, every
reserved token dispatched), with its own ``LeasedLimiter`` and ``Refresher``.
The refresher's rounds run when the test says (``refresh``), against a real
redis-server, with the fake clock passed as the store's clock; answers are
applied at the engine's next step, as between real steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from harness.fake_clock import FakeClock
from vllm_output_rate.store.engine import open_store
from vllm_output_rate.store.leases import LeasedLimiter
from vllm_output_rate.store.refresher import Refresher
from vllm_output_rate.store.settings import StoreSettings


@dataclass
class SimEngine:
    name: str
    limiter: LeasedLimiter
    refresher: Refresher
    clock: FakeClock
    demand: dict[str, int] = field(default_factory=dict)
    generation: int = 0
    # user -> clock readings of every token dispatched here
    dispatched: dict[str, list[int]] = field(default_factory=dict)
    alive: bool = True

    @classmethod
    def create(
        cls,
        name: str,
        settings: StoreSettings,
        clock: FakeClock,
        default_rate: float,
        user_rates: Mapping[str, float] | None = None,
    ) -> SimEngine:
        limiter = LeasedLimiter(default_rate, user_rates, settings, clock=clock)
        refresher = Refresher(limiter, open_store(settings), name)
        return cls(name, limiter, refresher, clock)

    def set_demand(self, user: str, streams: int) -> None:
        if (streams > 0) != (self.demand.get(user, 0) > 0):
            self.generation += 1
        if streams > 0:
            self.demand[user] = streams
        else:
            self.demand.pop(user, None)

    def refresh(self) -> None:
        if self.alive:
            self.refresher.run_once(now_us=self.clock.now_ns // 1000)

    def step(self) -> dict[str, int]:
        if not self.alive:
            return {}
        self.limiter.between_steps(self.demand, self.generation)
        got = self.limiter.take_many(dict(self.demand))
        now = self.clock.now_ns
        for user, count in got.items():
            if count:
                self.dispatched.setdefault(user, []).extend([now] * count)
        return got

    def close(self) -> None:
        self.refresher.store.close()


def merged(engines: list[SimEngine], user: str) -> list[int]:
    """Every engine's dispatch times of ``user``, merged and sorted."""
    times: list[int] = []
    for engine in engines:
        times += engine.dispatched.get(user, [])
    return sorted(times)
