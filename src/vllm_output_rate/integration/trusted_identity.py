"""Take the user from a verified API key instead of the request body.

With ``--output-rate-api-keys FILE`` (and the HTTP plugin enabled), no
request reaches the engine without a verified user, whatever route it came
by. Two parts:

* ``TrustedIdentityMiddleware`` (pure ASGI, HTTP and WebSocket) records the
  user of ``Authorization: Bearer KEY``, or none, in a ``RequestIdentity``;
  it answers 401 to an unknown key on any route but the admin routes, and
  to a request without a key under the prefixes vLLM's ``--api-key`` guards;
  for a request without a valid key it holds the status line until the
  first body chunk, so that a refused stream answers 401, not 200.
* ``stamp_or_refuse``, at the funnel every route passes into the engine
  (``seams.FUNNEL``, wrapped by ``api_validation.guard_engine_client``),
  writes the verified user into the request, or refuses it
  (``IdentityRequiredError``, HTTP 401) before anything is registered.

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

from vllm.exceptions import GracefulHTTPError

from vllm_output_rate import seams
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
        self._guarded = seams.api_key_guarded_prefixes()

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
        if (token and user is None) or (user is None and self._needs_key(scope)):
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
