"""The engine-side end of the operator channel.

Installed on vLLM's EngineCore class by the general plugin (as
``seams.RPC_METHOD``); the API server's HTTP plugin calls it through vLLM's
own utility-call channel (``engine_client.engine_core.call_utility_async``).
Errors raised here are returned to the caller by vLLM, never crash the engine.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.integration import admission_rpc
from vllm_output_rate.validation import OutputRateConfigError

# The key of an "update" answer that refused the change (its reason).
REFUSED = "refused"


def output_rate_rpc(engine_core: Any, op: str, payload: Any = None) -> Any:
    # Our schedulers hold their policy as `output_rate`; vLLM's have none.
    policy = getattr(engine_core.scheduler, "output_rate", None)
    if policy is None:
        raise RuntimeError("per-user output rate limiting is not enabled")
    # With asynchronous scheduling a step may be scheduled and not settled
    # yet when the engine serves this call: settle it first.
    policy.finish_step()
    if op == "metrics":
        return policy.metrics_snapshot()
    if op == "users":
        return policy.users_snapshot(payload["limit"], payload.get("after"))
    if op == "admission":
        return admission_rpc.admission_view(engine_core, policy, payload)
    if op == "limits":
        return admission_rpc.limits_page(engine_core, policy, payload)
    if op == "update":
        # The change, then the first page of the limits now in force. What
        # only the engine can check (a floor above its user's limit, prompt
        # rates while prompt limiting is off) is refused whole: the API
        # server answers HTTP 400 with the reason.
        try:
            admission_rpc.update_limits(engine_core, policy, payload["body"])
        except OutputRateConfigError as exc:
            return {REFUSED: str(exc)}
        return admission_rpc.limits_page(engine_core, policy, payload["page"])
    raise ValueError(f"unknown operation {op!r}")
