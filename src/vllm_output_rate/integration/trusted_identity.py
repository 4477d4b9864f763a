"""Take the user from a verified API key instead of the request body.

With ``--output-rate-api-keys FILE`` (and the HTTP plugin enabled), every
generation request (POST under /v1) must carry ``Authorization: Bearer KEY``
for a key in the file; the key's user replaces whatever
``vllm_xargs.output_rate_user`` the client sent. Missing or unknown keys get
HTTP 401, with no hint about which users exist.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any

from vllm_output_rate.api_keys import ApiKeys
from vllm_output_rate.identity import USER_FIELD

# The verified user of the request being handled (set by the middleware,
# read where vLLM builds the request's sampling parameters).
verified_user: ContextVar[str | None] = ContextVar("output_rate_user", default=None)
# Operator routes have their own key.
UNGUARDED_PREFIXES = ("/v1/output_rate/",)


class TrustedIdentityMiddleware:
    """A pure ASGI middleware, so the context variable reaches the handler."""

    def __init__(self, app: Any, keys_holder: Any) -> None:
        self.app = app
        self._holder = keys_holder  # has .api_keys: ApiKeys | None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        keys: ApiKeys | None = self._holder.api_keys
        if (
            keys is None
            or scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith("/v1/")
            or scope["path"].startswith(UNGUARDED_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        user = keys.user_for(_bearer_token(scope))
        if user is None:
            await _unauthorized(send)
            return
        token = verified_user.set(user)
        try:
            await self.app(scope, receive, send)
        finally:
            verified_user.reset(token)


def _bearer_token(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return str(token).strip()
    return ""


async def _unauthorized(send: Any) -> None:
    body = json.dumps(
        {"error": {"message": "a valid API key is required", "code": 401}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def apply_verified_user(params: Any) -> None:
    """Overwrite the client-supplied user with the verified one, if any."""
    user = verified_user.get()
    if user is None:
        return
    extra_args = dict(getattr(params, "extra_args", None) or {})
    extra_args[USER_FIELD] = user
    params.extra_args = extra_args
