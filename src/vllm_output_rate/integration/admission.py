"""Admission in the API server: per-user caps (429), vLLM's global caps
(503) that paused requests cannot fill, and rate-limit headers.

Installed by the HTTP plugin on its engine client (``seams.ENGINE_CLIENT``):

* ``check_admission`` (vLLM calls it before rendering, ``_preflight``):
  with the request's user known (trusted identity, or the body that
  ``BaseServing._check_model`` just saw), a request over the user's own caps
  gets HTTP 429 with ``Retry-After``; n alone above the cap gets 400. Then
  vLLM's global caps, counting no request of a user its own limit holds back
  (``EngineViews.is_paused``): 503 only for true overload. An admitted
  request reserves its place (counted by both) until it registers, so
  concurrent requests cannot all pass, and vLLM's second check as it
  registers passes: a stream that started is never refused inside.
* the funnel (``seams.FUNNEL``, inside the identity guard): every request's
  user is checked there too (routes whose body names no user), and its
  registration recorded in ``Ledger``, which counts a user's requests from
  vLLM's own output processor (sequences of ``n`` each, released when vLLM
  drops them: finished or aborted).
* ``AdmissionMiddleware``: one ``AdmissionContext`` per HTTP request; adds
  the ``x-ratelimit-*`` headers (and a 429's ``Retry-After``) to the
  response of every request whose user was checked, streamed or not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm.exceptions import (
    GracefulHTTPError,
    MaxQueuedTokensError,
    QueueOverflowError,
    VLLMValidationError,
)

from vllm_output_rate import seams
from vllm_output_rate.admission_caps import (
    GLOBAL_REQUESTS,
    GLOBAL_TOKENS,
    OWN_REQUESTS,
    GlobalCaps,
    rate_limit_headers,
    refusal,
    retry_after_s,
    retry_headers,
)
from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.identity import USER_FIELD, user_from_extra_args
from vllm_output_rate.integration.admission_view import EngineViews
from vllm_output_rate.integration.trusted_identity import verified_user
from vllm_output_rate.validation import OutputRateConfigError

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
OTHER_LABEL = "__other__"
# Per-user rejection counts (for the stats route) are kept this long.
REJECTIONS_KEPT_S = 600.0


class UserOverCapError(GracefulHTTPError):
    """The user's own excess: vLLM's handlers answer it with HTTP 429."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.TOO_MANY_REQUESTS)


@dataclass
class AdmissionContext:
    """One HTTP request's admission (shared by reference with its tasks)."""

    request: Any = None  # the API request object, once its model was checked
    user: str | None = None  # whose caps it was checked against
    reserved: int = 0  # sequences reserved at the door, not yet registered
    registered: bool = False
    new_tokens: int = 0  # its max_tokens, while not yet in the engines' view
    refused: tuple[str, int] | None = None  # a 429's reason, requests held


current: ContextVar[AdmissionContext | None] = ContextVar(
    "output_rate_admission", default=None
)
# Set while a request this module admitted registers: vLLM's own second
# check then passes (its place is counted, as a reservation, until then).
_admitted: ContextVar[bool] = ContextVar("output_rate_admitted", default=False)


class Ledger:
    """Each user's requests in this API server, counted from vLLM's own
    output processor (a request is in flight while vLLM tracks it)."""

    def __init__(self, output_processor: Any) -> None:
        self._states: dict[str, Any] = output_processor.request_states
        self._parents: dict[str, Any] = output_processor.parent_requests
        self.entries: dict[str, dict[str, int]] = {}  # user -> {id: n}
        # Admitted, not registered yet (counted against the caps meanwhile).
        self.reserved: dict[str, int] = {}
        self.reserved_total = 0

    def reserve(self, user: str, n: int) -> None:
        self.reserved[user] = self.reserved.get(user, 0) + n
        self.reserved_total += n

    def release(self, user: str, n: int) -> None:
        held = self.reserved.get(user, 0)
        self.reserved_total -= min(n, held)
        if held > n:
            self.reserved[user] = held - n
        else:
            self.reserved.pop(user, None)

    def register(self, user: str, request_id: str, n: int) -> None:
        self.entries.setdefault(user, {})[request_id] = n

    def _live(self, request_id: str, n: int) -> list[Any]:
        """The vLLM request states of one entry still in flight."""
        if n == 1:
            state = self._states.get(request_id)
            return [] if state is None else [state]
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [s for c in parent.child_requests if (s := self._states.get(c))]

    def in_flight(self, user: str) -> int:
        """The user's registered sequences in flight (finished ones dropped)."""
        entries = self.entries.get(user)
        if not entries:
            return 0
        count = 0
        for request_id, n in list(entries.items()):
            live = len(self._live(request_id, n))
            if live:
                count += live
            else:
                del entries[request_id]
        if not entries:
            del self.entries[user]
        return count

    def requests(self, user: str) -> int:
        return self.in_flight(user) + self.reserved.get(user, 0)

    def queued_tokens(self, user: str) -> int:
        """Prompt tokens of the user's requests still in prefill (as vLLM
        counts them for its own token cap)."""
        return sum(
            state.prompt_len
            for request_id, n in list(self.entries.get(user, {}).items())
            for state in self._live(request_id, n)
            if state.is_prefilling
        )

    def users(self) -> list[str]:
        return list(self.entries.keys() | self.reserved.keys())

    def live_users(self) -> list[str]:
        """Users with requests in flight or places reserved, dropping every
        finished request (run periodically: a user that never comes back
        leaves no entry behind)."""
        for user in list(self.entries):
            self.in_flight(user)
        return self.users()


class Admission:
    def __init__(
        self, engine_client: Any, views: EngineViews, *, identity_required: bool
    ) -> None:
        self.client = engine_client
        self.views = views
        self.identity_required = identity_required
        self.ledger = Ledger(engine_client.output_processor)
        config = engine_client.scheduler_config
        self.global_caps = GlobalCaps(
            config.max_num_queued_reqs, config.max_num_queued_tokens
        )
        views.global_caps = self.global_caps
        # (metrics label, reason) -> refusals; user -> [reason counts, last].
        self.rejections: dict[tuple[str, str], int] = {}
        self.by_user: dict[str, tuple[dict[str, int], float]] = {}

    # ----- who asks --------------------------------------------------------

    def user_of_request(self, request: Any) -> str | None:
        """The user an API request names, before it is rendered (None: its
        kind names none here; the funnel checks it)."""
        if self.identity_required:
            return verified_user()  # none: refused with 401 further on
        if hasattr(request, "vllm_xargs"):
            extra_args = request.vllm_xargs
        else:
            params: Any = getattr(request, "sampling_params", None)
            if params is None or not hasattr(params, "extra_args"):
                return None
            extra_args = params.extra_args
        try:
            return user_from_extra_args(extra_args)
        except OutputRateConfigError as exc:
            raise VLLMValidationError(
                str(exc), parameter=f"vllm_xargs.{USER_FIELD}"
            ) from None

    # ----- the checks ------------------------------------------------------

    def own_requests(self, user: str) -> int:
        return self.ledger.requests(user) + self.views.elsewhere.get(user, 0)

    def admit_user(self, user: str, n: int, context: AdmissionContext | None) -> None:
        """Refuse the user's own excess (429, or 400 for n alone)."""
        caps, global_caps = self.views.caps, self.global_caps
        requests_cap = caps.requests_of(user, global_caps)
        tokens_cap = caps.tokens_of(user, global_caps)
        if requests_cap is None and tokens_cap is None:
            return
        own = self.own_requests(user) if requests_cap is not None else 0
        queued = self.ledger.queued_tokens(user) if tokens_cap is not None else 0
        refused = refusal(n, requests_cap, tokens_cap, own, queued)
        if refused is None:
            return
        self.count_rejection(user, refused.reason)
        if refused.status == 400:
            raise VLLMValidationError(refused.message, parameter="n")
        if context is not None:
            context.user, context.refused = user, (refused.reason, own)
        raise UserOverCapError(refused.message)

    def check_global(self, n: int, user: str | None) -> None:
        """vLLM's own caps (``check_admission``), counting no request of a
        user its own limit holds back: those are bounded by the user's caps."""
        client, config = self.client, self.client.scheduler_config
        cap = config.max_num_queued_reqs
        if cap is not None:
            stats = client.admission_stats
            count = (
                stats.get_num_requests()
                if stats is not None
                else client.get_num_unfinished_requests()
            ) + self.ledger.reserved_total
            if count + n > cap:
                count -= self._paused_requests(elsewhere_counted=stats is not None)
                if count + n > cap:
                    self._global_refusal(GLOBAL_REQUESTS, user)
                    raise QueueOverflowError()
        token_cap = config.max_num_queued_tokens
        if token_cap is not None:
            tokens = client.get_num_queued_tokens()
            if tokens >= token_cap:
                tokens -= sum(
                    self.ledger.queued_tokens(u)
                    for u in self._paused(self.ledger.users())
                )
                if tokens >= token_cap:
                    self._global_refusal(GLOBAL_TOKENS, user)
                    raise MaxQueuedTokensError()

    def _paused(self, users: Iterable[str]) -> list[str]:
        return [u for u in users if self.views.is_paused(u)]

    def _paused_requests(self, elsewhere_counted: bool) -> int:
        count = sum(self.ledger.requests(u) for u in self._paused(self.ledger.users()))
        if elsewhere_counted:
            elsewhere = self.views.elsewhere
            count += sum(elsewhere[u] for u in self._paused(elsewhere))
        return count

    def _global_refusal(self, reason: str, user: str | None) -> None:
        seams.record_admission_rejection(self.client, reason)
        if user is not None:
            self.count_rejection(user, reason)

    def count_rejection(self, user: str, reason: str) -> None:
        view = self.views.view(user)
        label = view.label if view is not None and view.label else OTHER_LABEL
        if user == ANONYMOUS_USER:
            label = user
        key = (label, reason)
        self.rejections[key] = self.rejections.get(key, 0) + 1
        counts, _ = self.by_user.get(user, ({}, 0.0))
        counts[reason] = counts.get(reason, 0) + 1
        self.by_user[user] = (counts, time.monotonic())

    def forget_old_rejections(self) -> None:
        horizon = time.monotonic() - REJECTIONS_KEPT_S
        self.by_user = {u: r for u, r in self.by_user.items() if r[1] >= horizon}

    # ----- the two places vLLM calls --------------------------------------

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """In place of vLLM's ``AsyncLLM.check_admission``."""
        if request_id is not None and _admitted.get():
            return
        context = current.get()
        user = None
        if request_id is None and context is not None and context.request is not None:
            user = self.user_of_request(context.request)
            context.request = None  # one check per rendering
        if user is not None and context is not None:
            self.views.watch(user)
            self.admit_user(user, n, context)
            context.user = user  # a 503 carries the user's headers too
            self.check_global(n, user)
            self.ledger.reserve(user, n)
            context.reserved += n
            return
        self.check_global(n, None)

    async def enter(
        self,
        original: Callable[..., Awaitable[Any]],
        request_id: str,
        prompt: Any,
        params: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """The funnel: check the user unless its place was reserved at the
        door, then record the registered request in the ledger."""
        user = _user_of_params(params)
        n = int(getattr(params, "n", 1) or 1)
        context = current.get()
        if context is not None and context.user == user and context.reserved:
            held, context.reserved = context.reserved, 0
        else:
            self.admit_user(user, n, context)
            self.check_global(n, user)
            self.ledger.reserve(user, held := n)
        token = _admitted.set(True)
        try:
            queue = await original(request_id, prompt, params, *args, **kwargs)
        except BaseException:
            self.ledger.release(user, held)
            raise
        finally:
            _admitted.reset(token)
        self.ledger.register(user, getattr(queue, "request_id", request_id), n)
        self.ledger.release(user, held)
        self.views.watch(user)
        if context is not None:
            context.user, context.registered = user, True
        return queue

    def end(self, context: AdmissionContext) -> None:
        """The HTTP request is over: give back a place never registered."""
        if context.reserved and context.user is not None:
            self.ledger.release(context.user, context.reserved)
            context.reserved = 0

    # ----- headers -----------------------------------------------------------

    async def headers(self, context: AdmissionContext) -> dict[str, str]:
        user = context.user
        if user is None:
            return {}
        view = await self.views.fetch(user)
        headers: dict[str, str] = {}
        if view is not None and view.limit > 0:
            own = self.own_requests(user)
            headers = rate_limit_headers(
                view,
                new_tokens=0 if context.registered else context.new_tokens,
                requests_cap=self.views.caps.requests_of(user, self.global_caps),
                own_requests=own,
                requests_reset_s=retry_after_s(
                    view, OWN_REQUESTS, own, context.new_tokens
                ),
            )
        if context.refused is not None:
            reason, own = context.refused
            wait = retry_after_s(view, reason, own, context.new_tokens)
            headers.update(retry_headers(wait))
        return headers


def _user_of_params(params: Any) -> str:
    """The user a request entering the engine belongs to (its name was
    validated by the identity guard around this funnel)."""
    try:
        return user_from_extra_args(getattr(params, "extra_args", None))
    except OutputRateConfigError:
        return ANONYMOUS_USER


def requested_tokens(request: Any) -> int:
    """The most output tokens an API request asks for, when it says."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(request, name, None)
        if isinstance(value, int) and value > 0:
            return value * max(1, int(getattr(request, "n", 1) or 1))
    params = getattr(request, "sampling_params", None)
    value = getattr(params, "max_tokens", None)
    return value if isinstance(value, int) and value > 0 else 0


class AdmissionMiddleware:
    """Gives every HTTP request an ``AdmissionContext`` and its response the
    admission headers (at its start: for a stream, at admission)."""

    def __init__(self, app: Any, holder: Any) -> None:
        self.app = app
        self._holder = holder  # has .admission: Admission | None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        admission: Admission | None = self._holder.admission
        if admission is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = AdmissionContext()
        token = current.set(context)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and context.user is not None:
                extra = await admission.headers(context)
                if extra:
                    message = {
                        **message,
                        "headers": [
                            *message.get("headers", []),
                            *((k.encode(), v.encode()) for k, v in extra.items()),
                        ],
                    }
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            current.reset(token)
            admission.end(context)


def note_checked_request(request: Any) -> None:
    """Called with each API request whose model vLLM just checked, right
    before its admission check (``seams.MODEL_CHECK``)."""
    context = current.get()
    if context is not None:
        context.request = request
        context.new_tokens = requested_tokens(request)


def install(engine_client: Any, admission: Admission) -> None:
    """Put ``admission`` in the engine client's ``check_admission`` and
    funnel (on this instance; call before the identity guard wraps the
    funnel, so that this check sees the verified user)."""
    original = getattr(engine_client, seams.FUNNEL)

    async def funnel(
        request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
    ) -> Any:
        return await admission.enter(
            original, request_id, prompt, params, *args, **kwargs
        )

    setattr(engine_client, seams.FUNNEL, funnel)
    setattr(engine_client, seams.ADMISSION_CHECK, admission.check_admission)


async def forget_old_rejections(admission: Admission) -> None:
    while True:
        await asyncio.sleep(60)
        admission.forget_old_rejections()
