"""Start one engine's leasing from a shared store (no vLLM import).

The one place that chooses the store's implementation (Redis/Valkey,
``redis_store.py``); everything else speaks ``messages.LeaseStore``.
"""

from __future__ import annotations

import logging

from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.store.leases import LeasedLimiter
from vllm_output_rate.store.messages import LeaseStore
from vllm_output_rate.store.redis_store import RedisLeaseStore
from vllm_output_rate.store.refresher import Refresher, engine_id
from vllm_output_rate.store.settings import StoreSettings


def open_store(settings: StoreSettings) -> LeaseStore:
    """A client of the store ``settings`` name (it connects on first use)."""
    return RedisLeaseStore(settings)


def start_leasing(
    settings: OutputRateSettings,
    *,
    data_parallel_rank: int,
    data_parallel_size: int,
    logger: logging.Logger,
) -> tuple[LeasedLimiter, Refresher]:
    """A leased limiter for ``settings`` (which name a store) and its
    running refresher. The first round runs before this returns, so an
    engine that reaches the store starts with its limits; one that does not
    starts serving at its fallback share (the start-up check in the API
    server has already refused that when the store is required)."""
    store_settings = settings.store
    assert store_settings is not None
    limiter = LeasedLimiter(
        settings.default_rate,
        settings.user_rates,
        store_settings,
        # Before it has seen the store, an engine knows at least its DP peers.
        engines_hint=data_parallel_size,
        logger=logger,
    )
    refresher = Refresher(
        limiter,
        open_store(store_settings),
        engine_id(data_parallel_rank),
        logger,
    )
    refresher.run_once()
    refresher.start()
    logger.info(
        "Output rate limits shared through %s as engine %s (lease %g s, refresh %g s)",
        store_settings.display_url,
        refresher.engine,
        store_settings.lease_s,
        store_settings.refresh_s,
    )
    return limiter, refresher
