"""Check every request on its way into the engine; refuse what the rate
limiter cannot account for.

Two places, both in the API server:

* ``check_sampling_params`` runs while an OpenAI request (chat, completion,
  responses) is converted to sampling parameters, before any response
  starts, so even streaming requests get a real HTTP error rather than an
  error event inside a 200 stream;
* ``guard_engine_client`` wraps the engine client's funnel
  (``seams.FUNNEL``), which every route's request passes on its way into the
  engine, including routes that take raw sampling parameters
  (``/inference/v1/generate``) and routes a later vLLM adds.

Both apply the same rule: with an identity option on (API keys, a gateway
header or body fields, the cache salt), the request gets the user
``identity.decide`` names or is refused (HTTP 401 or 400,
trusted_identity.py); otherwise a malformed ``output_rate_user`` gets HTTP
400.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate import seams
from vllm_output_rate.identity import USER_FIELD, user_from_extra_args
from vllm_output_rate.integration import engine_setup, trusted_identity
from vllm_output_rate.integration.trusted_identity import (
    IdentityPolicy,
    note_api_request,
    stamp_or_refuse,
)
from vllm_output_rate.validation import OutputRateConfigError


def check_sampling_params(params: Any, request: Any = None) -> None:
    """``request``: the API request ``params`` were made from."""
    if not engine_setup.limiting_enabled:
        return
    if trusted_identity.policy is not None:
        if request is not None:
            note_api_request(request)
        stamp_or_refuse(None, params)
    else:
        check_user(params)


def check_user(params: Any) -> None:
    """VLLMValidationError (HTTP 400) for a malformed ``output_rate_user``."""
    try:
        user_from_extra_args(getattr(params, "extra_args", None))
    except OutputRateConfigError as exc:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(
            str(exc), parameter=f"vllm_xargs.{USER_FIELD}"
        ) from None


def refuse_beam_search() -> None:
    if not engine_setup.limiting_enabled:
        return
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(
        "beam search is not supported while per-user output rate limiting is on: "
        "its candidate expansion does not sample one token per step",
        parameter="use_beam_search",
    )


def guard_engine_client(engine_client: Any, policy: IdentityPolicy | None) -> None:
    """Wrap the engine client's funnel (``seams.FUNNEL``) on this instance.

    With a ``policy`` every request gets its decided user (and salt) or is
    refused there; otherwise a malformed ``output_rate_user`` is refused.
    """
    module, name = seams.ENGINE_CLIENT
    if not isinstance(engine_client, seams.resolve(module, name)):
        if policy is not None:  # fail closed: its requests cannot be seen
            raise OutputRateConfigError(
                f"trusted identity and cache isolation need vLLM's {name} "
                f"engine client; this server runs {type(engine_client).__qualname__}"
            )
        return
    original = getattr(engine_client, seams.FUNNEL)

    async def funnel(
        request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if policy is not None:
            prompt, params = stamp_or_refuse(prompt, params)
        else:
            check_user(params)
        return await original(request_id, prompt, params, *args, **kwargs)

    setattr(engine_client, seams.FUNNEL, funnel)
    trusted_identity.policy = policy
