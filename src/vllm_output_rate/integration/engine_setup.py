"""Turn a finished VllmConfig into a rate-limited one, or leave it stock."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from vllm_output_rate.config import OutputRateSettings
from vllm_output_rate.integration.compat import check_supported_config
from vllm_output_rate.store.engine import open_store
from vllm_output_rate.store.messages import (
    StoreIncompatible,
    StoreUnavailable,
)
from vllm_output_rate.store.settings import (
    STORE_FLAG,
    STORE_REQUIRED_FLAG,
    StoreSettings,
)
from vllm_output_rate.validation import OutputRateConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SYNC_SCHEDULER = "vllm_output_rate.integration.scheduler.OutputRateScheduler"
ASYNC_SCHEDULER = "vllm_output_rate.integration.scheduler.OutputRateAsyncScheduler"
OUR_SCHEDULERS = {SYNC_SCHEDULER, ASYNC_SCHEDULER}
# vLLM's CPU platform turns asynchronous scheduling off; this switches it back
# on (used by the end-to-end tests of the async scheduler on CPU machines).
CPU_ASYNC_ENV = "VLLM_OUTPUT_RATE_CPU_ASYNC_SCHEDULING"

# Set in the process that built a rate-limited config (the API server), so
# request validation there knows that limiting is on.
limiting_enabled = False
prompt_limiting_enabled = False  # the same, for prompt-token rates
logger = logging.getLogger("vllm.output_rate")


def _qualname(scheduler_cls: str | type) -> str:
    if isinstance(scheduler_cls, str):
        return scheduler_cls
    return f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}"


def apply_output_rate(vllm_config: VllmConfig) -> OutputRateSettings | None:
    """Validate the settings and select our scheduler; None when limiting is off.

    Raises OutputRateConfigError for settings or engine options that cannot
    be combined with per-user limits.
    """
    global limiting_enabled, prompt_limiting_enabled
    settings = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    if settings is None:
        return None
    check_supported_config(vllm_config, store=settings.store is not None)
    if settings.store is not None:
        check_store(settings.store)
    scheduler_config = vllm_config.scheduler_config
    requested = scheduler_config.scheduler_cls
    if requested is not None and _qualname(requested) not in OUR_SCHEDULERS:
        raise OutputRateConfigError(
            f"--scheduler-cls {_qualname(requested)} cannot be combined with "
            "per-user output rate limiting, which needs its own scheduler class; "
            "drop --scheduler-cls (the plugin selects it)"
        )
    if os.environ.get(CPU_ASYNC_ENV) == "1":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            scheduler_config.async_scheduling = True
    scheduler_config.scheduler_cls = (
        ASYNC_SCHEDULER if scheduler_config.async_scheduling else SYNC_SCHEDULER
    )
    limiting_enabled = True
    prompt_limiting_enabled = settings.prompt_limits is not None
    return settings


def check_store(store: StoreSettings) -> None:
    """Refuse a store that is not Redis-compatible, and an unreachable one
    when it is required; otherwise start anyway and say so."""
    client = open_store(store)
    try:
        version = client.check()
    except StoreIncompatible as exc:
        raise OutputRateConfigError(f"{STORE_FLAG}: {exc}") from None
    except StoreUnavailable as exc:
        if store.required:
            raise OutputRateConfigError(
                f"{STORE_FLAG}: {exc} ({STORE_REQUIRED_FLAG} refuses to start "
                "without it)"
            ) from None
        logger.warning(
            "%s: %s. Starting anyway: each engine serves every user at its "
            "fallback share until the store is reachable (give %s to refuse "
            "to start instead).",
            STORE_FLAG,
            exc,
            STORE_REQUIRED_FLAG,
        )
    else:
        logger.info("Output rate store %s: server %s", store.display_url, version)
    finally:
        client.close()
