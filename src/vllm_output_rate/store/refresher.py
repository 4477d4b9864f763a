"""The background thread that talks to the store for one engine (no vLLM import).

``Refresher`` drives one ``LeasedLimiter`` against one ``LeaseStore``
(``messages.py``). Every ``refresh_s`` (or at once when a user without a
lease appears) it sends one round (``LeasedLimiter.start_round``) in one
store round trip and posts the answer for the scheduler to apply between
steps (``finish_round``). Limit changes ride along: an operator's change on
this engine is written first; a newer version in the store is read and
applied. A store that holds no limits (new, or restarted without
persistence) gets this engine's. A failed round is posted as a failure; the
next cycle simply tries again, so an engine resumes by itself when the
store returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from socket import gethostname

from vllm_output_rate.store.leases import LeasedLimiter
from vllm_output_rate.store.messages import (
    Exchange,
    LeaseAsk,
    LeaseStore,
    Round,
    StoredLimits,
    StoreUnavailable,
)

# Users per script call: one call with 10,000 new users ran past the 0.25 s
# timeout here; a Lua script also blocks the server while it runs.
MAX_ASKS_PER_CALL = 256


def engine_id(data_parallel_rank: int = 0) -> str:
    """A name unique to this engine process (a restart gets a new one)."""
    return f"{gethostname()}-dp{data_parallel_rank}-{uuid.uuid4().hex[:8]}"


class Refresher:
    def __init__(
        self,
        limiter: LeasedLimiter,
        store: LeaseStore,
        engine: str,
        logger: logging.Logger | None = None,
    ) -> None:
        self.limiter = limiter
        self.store = store
        self.engine = engine
        self._logger = logger or logging.getLogger("vllm.output_rate")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, now_us: int | None = None) -> Exchange | None:
        """One round trip (plus limit reads and writes when needed).

        ``now_us`` stands in for the store's clock (simulations only).
        """
        limiter = self.limiter
        round_ = limiter.start_round()
        started = time.perf_counter()
        try:
            exchange, limits = self._exchange(round_, now_us)
        except StoreUnavailable as exc:
            limiter.finish_round(round_, None, error=str(exc))
            return None
        limiter.finish_round(
            round_, exchange, limits, round_trip_s=time.perf_counter() - started
        )
        return exchange

    def _exchange(
        self, round_: Round, now_us: int | None
    ) -> tuple[Exchange, StoredLimits | None]:
        store = self.store
        exchange = self._exchange_in_chunks(round_.asks, now_us)
        if exchange.limits_version < 0:
            # This engine's limits (an operator's changes included).
            default_rate, user_rates = round_.seed
            if store.seed_limits(default_rate, user_rates, round_.seed_members):
                self._logger.info(
                    "Output rate store %s held no limits: stored this engine's",
                    self.limiter.settings.display_url,
                )
            exchange = self._exchange_in_chunks(round_.asks, now_us)
        version = exchange.limits_version
        for write in round_.writes:
            version = store.update_limits(
                default_rate=write.default_rate,
                user_rates=write.user_rates,
                remove_users=write.remove_users,
                members=write.members,
                remove_members=write.remove_members,
            )
        limits = None
        if version != round_.limits_known:
            limits = store.read_limits()
        return exchange, limits

    def _exchange_in_chunks(self, asks: list[LeaseAsk], now_us: int | None) -> Exchange:
        """One call per MAX_ASKS_PER_CALL users, answers merged."""
        chunks = [
            asks[i : i + MAX_ASKS_PER_CALL]
            for i in range(0, len(asks), MAX_ASKS_PER_CALL)
        ] or [[]]
        rates: dict[str, float] = {}
        shared: set[str] = set()
        exchange = None
        for chunk in chunks:
            exchange = self.store.exchange(
                self.engine, chunk, grace_us=self.limiter.grace_us, now_us=now_us
            )
            rates.update(exchange.rates)
            shared |= exchange.shared
            if exchange.limits_version < 0:
                break
        assert exchange is not None
        return Exchange(
            exchange.now_us,
            exchange.limits_version,
            exchange.engines,
            exchange.fresh,
            rates,
            frozenset(shared),
        )

    # ----- the thread ---------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="output-rate-store", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        interval_s = self.limiter.settings.refresh_s
        kick = self.limiter.kick
        while not self._stop.is_set():
            kick.wait(interval_s)
            kick.clear()
            if self._stop.is_set():
                break
            try:
                self.run_once()
            except Exception:  # never let the thread die: limits would freeze
                self._logger.exception("Output rate store refresher failed a round")

    def stop(self) -> None:
        """Stop the thread and deregister (best effort)."""
        self._stop.set()
        self.limiter.kick.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.limiter.settings.timeout_s + 1)
        with contextlib.suppress(StoreUnavailable):
            self.store.leave(self.engine)
        self.store.close()
