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
  registration recorded in the ``Ledger`` (admission_ledger.py), which
  counts a user's requests from vLLM's own output processor.
* ``headers``: the ``x-ratelimit-*`` headers (and a 429's ``Retry-After``)
  that ``AdmissionMiddleware`` (admission_context.py) adds to the response
  of every request whose user was checked, streamed or not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
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
from vllm_output_rate.identity import user_from_extra_args
from vllm_output_rate.integration.admission_context import (
    AdmissionContext,
    admitted,
    current,
)
from vllm_output_rate.integration.admission_ledger import Ledger
from vllm_output_rate.integration.admission_view import EngineViews
from vllm_output_rate.integration.trusted_identity import user_of_api_request
from vllm_output_rate.validation import OutputRateConfigError

OTHER_LABEL = "__other__"
# Per-user rejection counts (for the stats route) are kept this long.
REJECTIONS_KEPT_S = 600.0


class UserOverCapError(GracefulHTTPError):
    """The user's own excess: vLLM's handlers answer it with HTTP 429."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.TOO_MANY_REQUESTS)


class Admission:
    def __init__(self, engine_client: Any, views: EngineViews) -> None:
        self.client = engine_client
        self.views = views
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
        """The user an API request belongs to, before it is rendered (None:
        not known here; the funnel decides, or refuses it without a key):
        the same decision as the funnel's, from the same sources."""
        return user_of_api_request(request)

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
        if request_id is not None and admitted.get():
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
        token = admitted.set(True)
        try:
            queue = await original(request_id, prompt, params, *args, **kwargs)
        except BaseException:
            self.ledger.release(user, held)
            raise
        finally:
            admitted.reset(token)
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
