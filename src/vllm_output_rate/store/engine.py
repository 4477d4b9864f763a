"""Start one engine's leasing from a shared store (no vLLM import).

The one place that chooses the store's implementation (Redis/Valkey,
``redis_store.py``); everything else speaks ``messages.LeaseStore``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from vllm_output_rate.store.leases import LeasedLimiter
from vllm_output_rate.store.messages import LeaseStore
from vllm_output_rate.store.redis_store import RedisLeaseStore
from vllm_output_rate.store.refresher import Refresher, engine_id
from vllm_output_rate.store.settings import StoreSettings


def open_store(settings: StoreSettings) -> LeaseStore:
    """A client of the store ``settings`` name (it connects on first use)."""
    return RedisLeaseStore(settings)


# Prompt-token limits and teams' output-token limits are budgets of their
# own under their own keys (``<prefix>:prompt``, ``<prefix>:team``, keyed
# by team), leased and refreshed like the users' output-token budget.
PROMPT_KEYS_SUFFIX = ":prompt"
TEAM_KEYS_SUFFIX = ":team"


def prompt_store_settings(settings: StoreSettings) -> StoreSettings:
    """Where the prompt-token budget lives in the store ``settings`` name."""
    return dataclasses.replace(
        settings, key_prefix=settings.key_prefix + PROMPT_KEYS_SUFFIX
    )


def team_store_settings(settings: StoreSettings) -> StoreSettings:
    """Where the teams' budget lives in the store ``settings`` name."""
    return dataclasses.replace(
        settings, key_prefix=settings.key_prefix + TEAM_KEYS_SUFFIX
    )


def start_leasing(
    default_rate: float,
    user_rates: Mapping[str, float],
    store_settings: StoreSettings,
    *,
    data_parallel_rank: int,
    data_parallel_size: int,
    logger: logging.Logger,
    budget: str = "per-user output-token",
    lend_unused: bool = True,
    members: Mapping[str, str] | None = None,
) -> tuple[LeasedLimiter, Refresher]:
    """A leased limiter of one budget (``budget``: which, for the log) at
    these limits, and its running refresher (``lend_unused``:
    ``lease_table.LeaseTable``; ``members``: ``LeasedLimiter``'s). The
    first round runs before
    this returns, so an engine that reaches the store starts with its
    limits; one that does not starts serving at its fallback share (the
    start-up check in the API server has already refused that when the
    store is required)."""
    limiter = LeasedLimiter(
        default_rate,
        user_rates,
        store_settings,
        # Before it has seen the store, an engine knows at least its DP peers.
        engines_hint=data_parallel_size,
        logger=logger,
        lend_unused=lend_unused,
        members=members,
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
        "%s limits shared through %s (keys {%s}) as engine %s "
        "(lease %g s, refresh %g s)",
        budget[0].upper() + budget[1:],
        store_settings.display_url,
        store_settings.key_prefix,
        refresher.engine,
        store_settings.lease_s,
        store_settings.refresh_s,
    )
    return limiter, refresher
