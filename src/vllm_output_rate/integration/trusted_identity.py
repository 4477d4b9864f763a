"""Whose request it is, decided once per request in the API server.

The HTTP plugin sets ``policy`` (``IdentityPolicy``: API keys, the gateway
header and body fields that may name the user, the cache salt option) at
start-up. Three parts apply ``identity.decide``'s one precedence order:

* ``IdentityMiddleware`` (pure ASGI, HTTP and WebSocket) records each
  request's ``Caller``: the user of ``Authorization: Bearer KEY`` and, from a
  caller that may assert identity (no keys, or a gateway key), the gateway
  header's user. It answers 401 to an unknown key on any route but the admin
  routes and to a missing one under the prefixes vLLM's ``--api-key``
  guards, 400 to a malformed header; for a request without a valid key it
  holds the status line until the first body chunk, so that a refused
  stream answers 401, not 200.
* ``note_api_request`` (each API request, before its admission check)
  records the user its body fields name, and ``user_of_api_request`` is the
  user admission checks before rendering.
* ``stamp_or_refuse``, at the funnel every route passes into the engine
  (``seams.FUNNEL``, wrapped by ``api_validation.guard_engine_client``),
  writes the decided user (and salt) into the request, or refuses it (401
  ``IdentityRequiredError``, 400 for a malformed name) before anything is
  registered.

Refusals never hint at which users exist. Why the funnel, not the URL:
docs/architecture.md, "Where each part runs"; the promise in full:
docs/operations.md, "Trusted identity".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError, VLLMValidationError

from vllm_output_rate import seams
from vllm_output_rate.api_keys import ApiKeys
from vllm_output_rate.identity import (
    ANONYMOUS_CALLER,
    USER_FIELD,
    Caller,
    Identity,
    decide,
    user_from_body_fields,
    user_from_header,
)
from vllm_output_rate.integration.cache_salt import salt_for, salted
from vllm_output_rate.validation import OutputRateConfigError

REFUSAL_MESSAGE = "a valid API key is required"
# Operator routes check their own admin key.
ADMIN_PREFIX = "/v1/output_rate/"

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class IdentityPolicy:
    """Where users come from in this API server (fixed at start-up)."""

    keys: ApiKeys | None = None
    header: str | None = None  # lower case
    body_fields: tuple[str, ...] = ()
    cache_salt: bool = False

    @property
    def reads_requests(self) -> bool:
        """Whether the middleware has anything to record."""
        return (
            self.keys is not None or self.header is not None or bool(self.body_fields)
        )


# Set by the HTTP plugin; None: no identity option, vLLM's body field only.
policy: IdentityPolicy | None = None


@dataclass
class RequestIdentity:
    """One HTTP/WebSocket request's caller, and the user its body fields
    name once seen. Shared by reference with every task the request's
    handler starts (they copy the context), so the middleware sees the
    funnel's ``refused``."""

    caller: Caller
    field_user: str | None = None
    refused: bool = False


# Set by the middleware for each request; read at the funnel.
current_identity: ContextVar[RequestIdentity | None] = ContextVar(
    "output_rate_identity", default=None
)


class IdentityRequiredError(GracefulHTTPError):
    """vLLM's handlers answer this with HTTP 401 (``GracefulHTTPError``)."""

    def __init__(self) -> None:
        super().__init__(REFUSAL_MESSAGE, HTTPStatus.UNAUTHORIZED)


class IdentityMiddleware:
    """Records each request's caller; turns refusals into 401s and 400s."""

    def __init__(self, app: Any, holder: Any) -> None:
        self.app = app
        self._holder = holder  # has .identity_policy: IdentityPolicy | None
        self._guarded = seams.api_key_guarded_prefixes()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        current: IdentityPolicy | None = self._holder.identity_policy
        if (
            current is None
            or not current.reads_requests
            or scope["type"] not in ("http", "websocket")
            or scope["path"].startswith(ADMIN_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        keys = current.keys
        key_user, may_assert = None, True
        if keys is not None:
            token = _bearer_token(scope)
            principal = keys.principal_for(token) if token else None
            if (token and principal is None) or (
                principal is None and self._needs_key(scope)
            ):
                await _refuse(scope, send, HTTPStatus.UNAUTHORIZED, REFUSAL_MESSAGE)
                return
            if principal is not None:
                key_user, may_assert = principal.user, principal.gateway
            else:
                may_assert = False
        header_user = None
        if current.header is not None and may_assert:
            name = current.header.encode("latin-1")
            values = [v for n, v in scope.get("headers", []) if n == name]
            try:
                header_user = user_from_header(values, current.header)
            except OutputRateConfigError as exc:
                await _refuse(scope, send, HTTPStatus.BAD_REQUEST, str(exc))
                return
        identity = RequestIdentity(Caller(key_user, may_assert, header_user))
        reset = current_identity.set(identity)
        try:
            if keys is not None and key_user is None and scope["type"] == "http":
                send = _refusal_aware(send, identity)
            await self.app(scope, receive, send)
        finally:
            current_identity.reset(reset)

    def _needs_key(self, scope: dict[str, Any]) -> bool:
        """Whether vLLM's own --api-key would refuse this request without a
        key (every method but OPTIONS, under its guarded prefixes)."""
        if scope.get("method") == "OPTIONS":
            return False
        path: str = scope["path"].removeprefix(scope.get("root_path", ""))
        return path.startswith(self._guarded)


def _refusal_aware(send: Send, identity: RequestIdentity) -> Send:
    """Hold the status line until the first body chunk; answer 401 instead
    if the funnel refused the request by then (and drop the rest)."""
    held: Message | None = None
    replaced = False

    async def guarded_send(message: Message) -> None:
        nonlocal held, replaced
        if replaced:
            return
        if message["type"] == "http.response.start":
            held = message
            return
        if held is not None:
            start, held = held, None
            if identity.refused:
                replaced = True
                await _answer(send, HTTPStatus.UNAUTHORIZED, REFUSAL_MESSAGE)
                return
            await send(start)
        await send(message)

    return guarded_send


def _bearer_token(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return str(token).strip()
    return ""


async def _refuse(
    scope: dict[str, Any], send: Send, status: HTTPStatus, message: str
) -> None:
    if scope["type"] == "websocket":
        # Policy violation, before the handshake is accepted.
        await send({"type": "websocket.close", "code": 1008})
    else:
        await _answer(send, status, message)


async def _answer(send: Send, status: HTTPStatus, message: str) -> None:
    kind = "Unauthorized" if status == HTTPStatus.UNAUTHORIZED else "BadRequestError"
    body = json.dumps(
        {"error": {"message": message, "type": kind, "code": status.value}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status == HTTPStatus.UNAUTHORIZED:
        headers.append((b"www-authenticate", b"Bearer"))
    await send(
        {"type": "http.response.start", "status": status.value, "headers": headers}
    )
    await send({"type": "http.response.body", "body": body})


# ----- deciding a request's user -------------------------------------------


def note_api_request(request: Any) -> None:
    """Record the user an API request's body fields name (HTTP 400 when
    malformed), from a caller whose fields count."""
    identity = current_identity.get()
    if policy is None or not policy.body_fields or identity is None:
        return
    if not identity.caller.may_assert:
        return
    try:
        identity.field_user = user_from_body_fields(request, policy.body_fields)
    except OutputRateConfigError as exc:
        raise VLLMValidationError(str(exc)) from None


_ABSENT: Any = object()


def user_of_api_request(request: Any) -> str | None:
    """The user an API request belongs to, before it is rendered (None:
    not known yet; the funnel decides, or refuses a request without a key)."""
    note_api_request(request)
    identity = current_identity.get()
    caller = identity.caller if identity is not None else ANONYMOUS_CALLER
    field_user = identity.field_user if identity is not None else None
    keys = policy is not None and policy.keys is not None
    if keys and caller.key_user is None:
        return None
    if hasattr(request, "vllm_xargs"):
        extra_args = request.vllm_xargs
    else:
        params: Any = getattr(request, "sampling_params", None)
        extra_args = getattr(params, "extra_args", _ABSENT)
    asserted = caller.may_assert and (
        caller.header_user is not None or field_user is not None
    )
    if extra_args is _ABSENT and not (keys or asserted):
        return None  # this kind names its user only as it enters the engine
    return _decided(
        caller, field_user, None if extra_args is _ABSENT else extra_args, keys
    ).user


def identity_at_funnel(params: Any) -> Identity:
    """The identity of a request entering the engine, or a refusal."""
    identity = current_identity.get()
    keys = policy is not None and policy.keys is not None
    if identity is None:
        if keys:  # outside any HTTP request: nobody verified
            raise IdentityRequiredError()
        caller, field_user = ANONYMOUS_CALLER, None
    else:
        caller, field_user = identity.caller, identity.field_user
        if keys and caller.key_user is None:
            identity.refused = True
            raise IdentityRequiredError()
    return _decided(caller, field_user, getattr(params, "extra_args", None), keys)


def _decided(
    caller: Caller, field_user: str | None, extra_args: Any, keys: bool
) -> Identity:
    try:
        return decide(caller, field_user, extra_args, keys=keys)
    except OutputRateConfigError as exc:
        raise VLLMValidationError(
            str(exc), parameter=f"vllm_xargs.{USER_FIELD}"
        ) from None


# ----- stamping a request with its user -----------------------------------


def stamp_or_refuse(prompt: Any, params: Any) -> tuple[Any, Any]:
    """Put the decided user (and, with the option, its cache salt) into a
    request about to enter the engine.

    ``prompt`` and ``params`` are the engine client's ``add_request``
    arguments; returns them with the user written into every set of sampling
    parameters the request carries (its own, an ``EngineCoreRequest``
    prompt's, each streamed input's). Raises IdentityRequiredError (401) or
    VLLMValidationError (400).
    """
    from vllm.v1.engine import EngineCoreRequest

    identity = identity_at_funnel(params)
    salt = salt_for(identity) if policy is not None and policy.cache_salt else None
    params = with_user(params, identity.user)
    if isinstance(prompt, EngineCoreRequest):
        prompt.sampling_params = with_user(prompt.sampling_params, identity.user)
    if isinstance(prompt, AsyncIterator):
        prompt = _stamped_inputs(prompt, identity.user, salt)
    elif salt is not None and prompt is not None:  # None: params only
        prompt = salted(prompt, salt)
    return prompt, params


def with_user(params: Any, user: str) -> Any:
    """``params`` with ``extra_args[USER_FIELD] = user`` (sampling params
    only; pooling parameters carry no user and pass unchanged)."""
    if params is None or not hasattr(params, "extra_args"):
        return params
    extra_args: Mapping[str, Any] = params.extra_args or {}
    params.extra_args = {**extra_args, USER_FIELD: user}
    return params


async def _stamped_inputs(
    inputs: AsyncIterator[Any], user: str, salt: str | None
) -> AsyncIterator[Any]:
    """Streamed inputs (vLLM's ``StreamingInput``) may bring their own
    sampling parameters; each one gets the user, and its prompt the salt."""
    async for chunk in inputs:
        with_user(getattr(chunk, "sampling_params", None), user)
        if salt is not None:
            chunk.prompt = salted(chunk.prompt, salt)
        yield chunk
