"""The engine-side end of the operator channel.

Installed on vLLM's EngineCore class by the general plugin; the API server's
HTTP plugin calls it through vLLM's own utility-call channel
(``engine_client.engine_core.call_utility_async``). Errors raised here are
returned to the caller by vLLM, never crash the engine.
"""

from __future__ import annotations

from typing import Any

RPC_METHOD = "output_rate_rpc"


def output_rate_rpc(engine_core: Any, op: str, payload: Any = None) -> Any:
    scheduler = engine_core.scheduler
    if not hasattr(scheduler, "output_rate_snapshot"):
        raise RuntimeError("per-user output rate limiting is not enabled")
    if op == "snapshot":
        return scheduler.output_rate_snapshot()
    if op == "limits":
        return scheduler.output_rate_limits()
    if op == "update":
        return scheduler.output_rate_update_limits(payload)
    raise ValueError(f"unknown operation {op!r}")
