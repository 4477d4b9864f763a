"""Which user a request belongs to (no vLLM import).

Clients name their user in ``vllm_xargs.output_rate_user``; vLLM hands that
dict to the engine as ``SamplingParams.extra_args``. The OpenAI ``user`` field
is ignored on purpose: it is free text that any client can set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.validation import OutputRateConfigError, validate_user_name

USER_FIELD = "output_rate_user"


def user_from_extra_args(extra_args: Mapping[str, Any] | None) -> str:
    """The user named in ``extra_args``, or the shared anonymous user.

    Raises ValueError (an OutputRateConfigError) when the field is present
    but is not a non-empty string of at most 256 characters.
    """
    if not extra_args or extra_args.get(USER_FIELD) is None:
        return ANONYMOUS_USER
    return validate_user_name(extra_args[USER_FIELD], f"vllm_xargs.{USER_FIELD}")


def user_or_anonymous(extra_args: Mapping[str, Any] | None) -> str:
    """Like ``user_from_extra_args`` but never raises (for the engine side).

    The API server refuses malformed names with HTTP 400 before they reach
    the engine; anything that still slips through (offline use) shares the
    anonymous budget rather than crashing the engine or escaping limits.
    """
    try:
        return user_from_extra_args(extra_args)
    except OutputRateConfigError:
        return ANONYMOUS_USER
