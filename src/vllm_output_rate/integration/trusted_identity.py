"""Take the user from a verified API key instead of the request body.

With ``--output-rate-api-keys FILE`` (and the HTTP plugin enabled), no
request reaches the engine without a verified user, whatever route it came
by. Two parts, so that the guarantee does not depend on knowing the routes:

* ``TrustedIdentityMiddleware`` (pure ASGI, HTTP and WebSocket) reads
  ``Authorization: Bearer KEY`` on every request and records the key's user,
  or none, in a per-request ``RequestIdentity``. A key that is given but
  unknown gets HTTP 401 on any route (the admin routes, which have their own
  key, excepted).
* ``stamp_or_refuse`` runs at the one funnel every route goes through into
  the engine, the API server's engine client (``seams.FUNNEL``, wrapped per
  instance by ``api_validation.guard_engine_client``): it writes the verified user into
  the request's sampling parameters, replacing whatever
  ``vllm_xargs.output_rate_user`` the client sent, or refuses the request
  (``IdentityRequiredError``, HTTP 401) before anything is registered. The
  OpenAI request classes run the same check earlier, while the request is
  converted to sampling parameters (see api_validation.py).

A refused request must not come back as a 200 whose stream holds an error:
for a request without a valid key the middleware holds the response's
status line until its first body chunk, and if the funnel refused the
request meanwhile, answers 401 instead. Requests with a valid key are
passed through untouched. Refusals never hint at which users exist.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError

from vllm_output_rate.api_keys import ApiKeys
from vllm_output_rate.identity import USER_FIELD

REFUSAL_MESSAGE = "a valid API key is required"
# Operator routes check their own admin key.
ADMIN_PREFIX = "/v1/output_rate/"

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class RequestIdentity:
    """The verified user of one HTTP/WebSocket request (None: no valid key).

    Shared by reference with every task the request's handler starts (they
    copy the context), so the middleware sees the funnel's ``refused``.
    """

    user: str | None
    refused: bool = False


# Set by the middleware for each request while API keys are on; read at the
# engine client funnel. None outside any request: the funnel refuses then.
current_identity: ContextVar[RequestIdentity | None] = ContextVar(
    "output_rate_identity", default=None
)


class IdentityRequiredError(GracefulHTTPError):
    """vLLM's handlers answer this with HTTP 401 (``GracefulHTTPError``)."""

    def __init__(self) -> None:
        super().__init__(REFUSAL_MESSAGE, HTTPStatus.UNAUTHORIZED)


def verified_user() -> str | None:
    identity = current_identity.get()
    return identity.user if identity is not None else None


class TrustedIdentityMiddleware:
    """Records each request's verified user; turns refusals into 401s."""

    def __init__(self, app: Any, keys_holder: Any) -> None:
        self.app = app
        self._holder = keys_holder  # has .api_keys: ApiKeys | None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        keys: ApiKeys | None = self._holder.api_keys
        if (
            keys is None
            or scope["type"] not in ("http", "websocket")
            or scope["path"].startswith(ADMIN_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        user = keys.user_for(token) if token else None
        if token and user is None:
            await _refuse(scope, send)
            return
        identity = RequestIdentity(user)
        reset = current_identity.set(identity)
        try:
            if user is None and scope["type"] == "http":
                send = _refusal_aware(send, identity)
            await self.app(scope, receive, send)
        finally:
            current_identity.reset(reset)


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
                await _unauthorized(send)
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


async def _refuse(scope: dict[str, Any], send: Send) -> None:
    if scope["type"] == "websocket":
        # Policy violation, before the handshake is accepted.
        await send({"type": "websocket.close", "code": 1008})
    else:
        await _unauthorized(send)


async def _unauthorized(send: Send) -> None:
    body = json.dumps(
        {
            "error": {
                "message": REFUSAL_MESSAGE,
                "type": "Unauthorized",
                "code": HTTPStatus.UNAUTHORIZED.value,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": HTTPStatus.UNAUTHORIZED.value,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ----- stamping a request with its verified user ---------------------------


def stamp_or_refuse(prompt: Any, params: Any) -> tuple[Any, Any]:
    """Put the verified user into a request about to enter the engine.

    ``prompt`` and ``params`` are the engine client's ``add_request``
    arguments; returns them with the user written into every set of sampling
    parameters the request carries (its own, an ``EngineCoreRequest``
    prompt's, each streamed input's). Raises IdentityRequiredError when the
    request has no verified user.
    """
    identity = current_identity.get()
    if identity is None or identity.user is None:
        if identity is not None:
            identity.refused = True
        raise IdentityRequiredError()
    from vllm.v1.engine import EngineCoreRequest

    user = identity.user
    params = with_user(params, user)
    if isinstance(prompt, EngineCoreRequest):
        prompt.sampling_params = with_user(prompt.sampling_params, user)
    elif isinstance(prompt, AsyncIterator):
        prompt = _stamped_inputs(prompt, user)
    return prompt, params


def with_user(params: Any, user: str) -> Any:
    """``params`` with ``extra_args[USER_FIELD] = user`` (sampling params
    only; pooling parameters carry no user and pass unchanged)."""
    if params is None or not hasattr(params, "extra_args"):
        return params
    extra_args: Mapping[str, Any] = params.extra_args or {}
    params.extra_args = {**extra_args, USER_FIELD: user}
    return params


async def _stamped_inputs(inputs: AsyncIterator[Any], user: str) -> AsyncIterator[Any]:
    """Streamed inputs (vLLM's ``StreamingInput``) may bring their own
    sampling parameters; each one gets the verified user."""
    async for chunk in inputs:
        with_user(getattr(chunk, "sampling_params", None), user)
        yield chunk
