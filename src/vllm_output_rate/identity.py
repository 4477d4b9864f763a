"""Which user a request belongs to: the one precedence order (no vLLM import).

Sources, first that names a user wins (``decide``):

1. the gateway header the operator names (``--output-rate-user-header``),
2. the body fields the operator names (``--output-rate-user-fields``), in
   the order given,
3. ``vllm_xargs.output_rate_user`` (vLLM hands it to the engine as
   ``SamplingParams.extra_args``): only without API keys,
4. the API key's own user, or without keys the shared anonymous user.

1 and 2 count only from a caller that may assert identity: any caller
without API keys, only a gateway key with them. A source that is present but
malformed is an error (HTTP 400), never skipped. The OpenAI ``user`` field
is not a source unless named: it is free text that any client can set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.validation import OutputRateConfigError, validate_user_name

USER_FIELD = "output_rate_user"
# Body fields that may name the user (--output-rate-user-fields).
BODY_FIELDS = ("safety_identifier", "user")


@dataclass(frozen=True)
class Identity:
    """Whom a request is charged to (a team would be carried beside the user)."""

    user: str


@dataclass(frozen=True)
class Caller:
    """What the HTTP layer knows of a request's caller before its body.

    ``key_user``: the API key's user (None without keys); ``may_assert``:
    whether the header and body fields count; ``header_user``: the header's
    user, validated (None when not sent or not counted).
    """

    key_user: str | None = None
    may_assert: bool = True
    header_user: str | None = None


ANONYMOUS_CALLER = Caller()


def user_from_extra_args(extra_args: Mapping[str, Any] | None) -> str:
    """The user named in ``extra_args``, or the shared anonymous user.

    Raises ValueError (an OutputRateConfigError) when the field is present
    but is not a valid user name (``validation.validate_user_name``).
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


def user_from_header(values: Sequence[bytes], header: str) -> str | None:
    """The user a gateway header names (None when absent).

    Sent twice, not UTF-8, empty, over 256 characters or with a control
    character: OutputRateConfigError.
    """
    if not values:
        return None
    if len(values) > 1:
        raise OutputRateConfigError(
            f"header {header}: sent {len(values)} times; send it once"
        )
    try:
        text = values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise OutputRateConfigError(f"header {header}: not UTF-8 text") from None
    return validate_user_name(text, f"header {header}")


def user_from_body_fields(request: Any, fields: Sequence[str]) -> str | None:
    """The user the first of ``fields`` present in an API request names
    (None: none present); a present field that is not a valid name raises."""
    for field in fields:
        value = getattr(request, field, None)
        if value is not None:
            return validate_user_name(value, field)
    return None


def decide(
    caller: Caller,
    field_user: str | None,
    extra_args: Mapping[str, Any] | None,
    *,
    keys: bool,
) -> Identity:
    """The precedence order of the module docstring; raises
    OutputRateConfigError for a malformed ``output_rate_user``."""
    if caller.may_assert:
        if caller.header_user is not None:
            return Identity(caller.header_user)
        if field_user is not None:
            return Identity(field_user)
    if not keys:
        return Identity(user_from_extra_args(extra_args))
    if caller.key_user is None:  # the caller checks for a key first
        raise OutputRateConfigError("a request without an API key has no user")
    return Identity(caller.key_user)
