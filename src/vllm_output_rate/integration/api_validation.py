"""Refuse, with HTTP 400, requests the rate limiter cannot account for.

These checks run in the API server while the request is converted to
sampling parameters, before any response starts, so even streaming requests
get a real 400 rather than an error event inside a 200 stream.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.identity import USER_FIELD, user_from_extra_args
from vllm_output_rate.integration import engine_setup
from vllm_output_rate.integration.trusted_identity import apply_verified_user
from vllm_output_rate.validation import OutputRateConfigError


def check_sampling_params(params: Any) -> None:
    if not engine_setup.limiting_enabled:
        return
    apply_verified_user(params)  # trusted identity, when configured
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
