"""The ``vllm.endpoint_plugins`` entry: metrics and the admin endpoint.

vLLM loads endpoint plugins only when they are named in ``VLLM_PLUGINS``;
since that variable then filters general plugins too, enable both:
``VLLM_PLUGINS=output_rate,output_rate_http``.

* Metrics: while limiting is on, per-user counters are polled from the
  engine once a second and exposed on vLLM's own ``/metrics``.
* Every request on its way into the engine, whatever its route, passes the
  engine client funnel: a malformed user gets HTTP 400; with API keys, a
  gateway header or body fields, the user is decided in one precedence
  order or the request is refused, and with the cache salt option its
  ``cache_salt`` is set from its user (see trusted_identity.py).
* Admin: with ``VLLM_OUTPUT_RATE_ADMIN_KEY`` set at start-up,
  ``GET/PUT /v1/output_rate/limits`` and ``GET /v1/output_rate/stats`` need
  ``Authorization: Bearer <key>``. Without the key the routes do not exist.
  Both GET routes page through users in name order: ``?limit=N`` (1 to
  10,000, default 1,000) and ``?after=NAME``. Stats: every user on record,
  the next page's ``after`` in the body's ``next``. Limits: the users with a
  limit, weight or floor of their own; the body stays a limits document, so
  the next page is in the ``Link`` header and the count in ``X-Total-Count``
  (a PUT answers the first page, or the one its query names).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from argparse import Namespace
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State

from vllm_output_rate.api_keys import ApiKeys
from vllm_output_rate.integration import admission, engine_setup
from vllm_output_rate.integration.admission_context import AdmissionMiddleware
from vllm_output_rate.integration.admission_setup import (
    check_limits_update,
    start_admission,
    with_rejections,
)
from vllm_output_rate.integration.api_validation import guard_engine_client
from vllm_output_rate.integration.engine_rpc import REFUSED
from vllm_output_rate.integration.metrics import OutputRateCollector
from vllm_output_rate.integration.trusted_identity import (
    IdentityMiddleware,
    IdentityPolicy,
)
from vllm_output_rate.seams import RPC_METHOD
from vllm_output_rate.seams_check import verify_seams
from vllm_output_rate.validation import OutputRateConfigError, validate_user_name

logger = logging.getLogger("vllm.output_rate")
ADMIN_KEY_ENV = "VLLM_OUTPUT_RATE_ADMIN_KEY"
POLL_INTERVAL_S = 1.0
PREFIX = "/v1/output_rate"
DEFAULT_PAGE = 1000
MAX_PAGE = 10_000


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status)


class OutputRateHttpPlugin:
    name = "output_rate_http"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self._admin_key = os.environ.get(ADMIN_KEY_ENV) or None
        self._engine: Any = None
        self._collector = OutputRateCollector()
        self._poller: asyncio.Task[None] | None = None
        self.identity_policy: IdentityPolicy | None = None  # read by its middleware
        self.admission: admission.Admission | None = None  # read by its middleware
        self._admission_tasks: list[asyncio.Task[None]] = []

    # ----- vLLM's EndpointPlugin protocol -------------------------------

    def attach_router(self, app: FastAPI) -> None:
        # Passes everything through until init_state sets a policy.
        app.add_middleware(IdentityMiddleware, holder=self)
        app.add_middleware(AdmissionMiddleware, holder=self)
        if self._admin_key is None:
            return  # the admin endpoint is off without a key
        router = APIRouter(prefix=PREFIX)
        router.add_api_route("/limits", self._get_limits, methods=["GET"])
        router.add_api_route("/limits", self._put_limits, methods=["PUT"])
        router.add_api_route("/stats", self._get_stats, methods=["GET"])
        app.include_router(router)

    async def init_state(
        self, engine_client: Any, state: State, args: Namespace
    ) -> None:
        if engine_client is None or not engine_setup.limiting_enabled:
            return
        verify_seams(api=True)
        policy = identity_policy(args)
        # Inside the identity guard: admission sees the decided user.
        self.admission, self._admission_tasks = start_admission(engine_client)
        self._collector.admission = self.admission
        guard_engine_client(engine_client, policy)
        self.identity_policy = policy
        self._engine = engine_client
        self._collector.register()
        self._poller = asyncio.create_task(self._poll_metrics())

    # ----- engine access ------------------------------------------------

    async def _call(self, op: str, payload: Any = None) -> Any:
        return await self._engine.engine_core.call_utility_async(
            RPC_METHOD, op, payload
        )

    async def _poll_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a missed poll keeps old values
                self._collector.update(await self._call("metrics"))
            await asyncio.sleep(POLL_INTERVAL_S)

    # ----- admin routes -------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.encode(), (self._admin_key or "").encode()
        )

    async def _guard(self, request: Request) -> JSONResponse | None:
        if not self._authorized(request):
            return _error(401, "a valid admin key is required")
        if self._engine is None:
            return _error(409, "per-user output rate limiting is not enabled")
        return None

    async def _get_limits(self, request: Request) -> JSONResponse:
        if refusal := await self._guard(request):
            return refusal
        try:
            page = parse_page(dict(request.query_params))
        except OutputRateConfigError as exc:
            return _error(400, str(exc))
        return _limits_response(request, page, await self._call("limits", page))

    async def _get_stats(self, request: Request) -> JSONResponse:
        if refusal := await self._guard(request):
            return refusal
        try:
            page = parse_page(dict(request.query_params))
        except OutputRateConfigError as exc:
            return _error(400, str(exc))
        return JSONResponse(with_rejections(await self._call("users", page), self))

    async def _put_limits(self, request: Request) -> JSONResponse:
        if refusal := await self._guard(request):
            return refusal
        try:
            page = parse_page(dict(request.query_params))
            payload = await request.json()
            check_limits_update(payload, self)  # refuse bad input before the engine
        except (ValueError, OutputRateConfigError) as exc:
            return _error(400, str(exc))
        answer = await self._call("update", {"body": payload, "page": page})
        if REFUSED in answer:
            return _error(400, answer[REFUSED])
        return _limits_response(request, page, answer)


def identity_policy(args: Namespace) -> IdentityPolicy | None:
    """Where this server's users come from (None: the body field only)."""
    keys_file = getattr(args, "output_rate_api_keys", None)
    policy = IdentityPolicy(
        keys=ApiKeys.load(keys_file) if keys_file else None,
        header=getattr(args, "output_rate_user_header", None),
        body_fields=getattr(args, "output_rate_user_fields", None) or (),
        cache_salt=getattr(args, "output_rate_cache_salt", None) == "user",
    )
    if policy == IdentityPolicy():
        return None
    if keys_file:
        logger.info(
            "Trusted identity on: every request into the engine needs an API "
            "key from %s; an ordinary key's user replaces any other source",
            keys_file,
        )
    if policy.header or policy.body_fields:
        logger.info(
            "Users named by %s from %s",
            ", ".join(
                [f"header {policy.header}"] * bool(policy.header)
                + [f"body field {f}" for f in policy.body_fields]
            ),
            "gateway keys" if keys_file else "any caller (no API keys)",
        )
    if policy.cache_salt:
        logger.info("Prefix cache isolated per user: cache_salt set from the user")
    return policy


def _limits_response(
    request: Request, page: dict[str, Any], answer: dict[str, Any]
) -> JSONResponse:
    """A page of limits: the body stays a limits document (a valid PUT
    body), so where the next page starts and how many users have limits of
    their own go in headers (RFC 8288's ``Link``, ``X-Total-Count``)."""
    headers = {"X-Total-Count": str(answer["total"])}
    if answer["next"] is not None:
        query = urlencode({"limit": page["limit"], "after": answer["next"]})
        headers["Link"] = f'<{request.url.path}?{query}>; rel="next"'
    return JSONResponse(answer["limits"], headers=headers)


def parse_page(query: dict[str, str]) -> dict[str, Any]:
    """``limit`` and ``after`` of a stats or limits page, validated."""
    unknown = set(query) - {"limit", "after"}
    if unknown:
        raise OutputRateConfigError(
            f"unknown query parameters {sorted(unknown)}; expected limit, after"
        )
    text = query.get("limit", str(DEFAULT_PAGE))
    if not text.isdigit() or not 1 <= int(text) <= MAX_PAGE:
        raise OutputRateConfigError(
            f"limit must be a whole number from 1 to {MAX_PAGE:,}, got {text!r}"
        )
    after = query.get("after")
    if after is not None:
        validate_user_name(after, "after")
    return {"limit": int(text), "after": after}
