"""What the engines last said about users, for admission in the API server.

``EngineViews`` asks every engine (each data-parallel rank) at most every
``REFRESH_S``, in the background, about the users this API server watches:
those with requests in flight here and those seen in the last ``WATCH_S``.
With several API server processes it also learns each user's requests sent
by the others (``elsewhere``). An admission check never waits on the
engines: it reads the last answer. Only the headers of a user's first
response, when nothing is known of it yet, wait for one answer (one call
per user however many requests ask, bounded by ``FETCH_TIMEOUT_S``).
The caps in force come with the answers, whenever their version changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from vllm_output_rate.admission_caps import (
    Caps,
    GlobalCaps,
    UserView,
    caps_from_document,
    merge_views,
)

logger = logging.getLogger("vllm.output_rate")
REFRESH_S = 0.1
WATCH_S = 2.0
# A user seen paused counts as paused this long: one that runs at its limit
# is paused between its tokens, and a reading that falls on a token's due
# time must not make its requests fill the global caps for a moment.
PAUSE_HOLD_S = 0.5
FETCH_TIMEOUT_S = 0.5

Call = Callable[[dict[str, Any]], Awaitable[list[Any]]]


class EngineViews:
    def __init__(
        self,
        call: Call,
        *,
        client: int = 0,
        others: bool = False,
        local_users: Callable[[], Iterable[str]] = tuple,
        global_caps: GlobalCaps | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._call = call
        self._client = client
        self._others = others
        self.local_users = local_users
        self._clock = clock
        self.views: dict[str, UserView] = {}
        self.elsewhere: dict[str, int] = {}
        self.caps = Caps()
        self.global_caps = global_caps or GlobalCaps()
        self.caps_version: int | None = None
        self._watched: dict[str, float] = {}
        self._paused_until: dict[str, float] = {}
        self._fetches: dict[str, asyncio.Future[UserView | None]] = {}
        self._failing = False

    def watch(self, user: str) -> None:
        self._watched[user] = self._clock()

    def view(self, user: str) -> UserView | None:
        return self.views.get(user)

    def is_paused(self, user: str) -> bool:
        """Whether the user's own limit holds it back (seen so in the last
        PAUSE_HOLD_S)."""
        until = self._paused_until.get(user)
        return until is not None and until > self._clock()

    def _payload(self, users: Iterable[str], others: bool) -> dict[str, Any]:
        return {
            "users": sorted(users),
            "client": self._client,
            "others": others,
            "caps_version": self.caps_version,
        }

    async def refresh(self) -> None:
        """One round: every watched user, and (several API servers) every
        user with requests from the others."""
        horizon = self._clock() - WATCH_S
        self._watched = {u: t for u, t in self._watched.items() if t >= horizon}
        users = set(self._watched).union(self.local_users())
        if not users and not self._others and self.caps_version is not None:
            self.views, self.elsewhere = {}, {}
            return
        answers = await self._call(self._payload(users, self._others))
        views, elsewhere = self._merge(answers)
        self.views, self.elsewhere = views, elsewhere
        now = self._clock()
        hold = {u: now + PAUSE_HOLD_S for u, v in views.items() if v.paused}
        self._paused_until = {
            **{u: t for u, t in self._paused_until.items() if t > now},
            **hold,
        }

    def _merge(self, answers: list[Any]) -> tuple[dict[str, UserView], dict[str, int]]:
        """The engines' answers as one view per user (and take new caps)."""
        per_user: dict[str, list[UserView]] = {}
        elsewhere: dict[str, int] = {}
        for answer in answers:
            if "caps" in answer:
                requests, tokens = answer["global_caps"]
                self.global_caps = GlobalCaps(requests, tokens)
                self.caps = caps_from_document(answer["caps"], self.global_caps)
                self.caps_version = answer["caps_version"]
            for user, row in answer["users"].items():
                limit, rate, wait_s, requests_here, outstanding, fewest, label, away = (
                    row
                )
                per_user.setdefault(user, []).append(
                    UserView(
                        limit=limit,
                        rate=rate,
                        wait_s=wait_s,
                        requests=requests_here,
                        outstanding=outstanding,
                        min_remaining=fewest,
                        label=label,
                    )
                )
                if away:
                    elsewhere[user] = elsewhere.get(user, 0) + away
        views = {}
        for user, found in per_user.items():
            merged = merge_views(found)
            if merged is not None:
                views[user] = merged
        return views, elsewhere

    async def fetch(self, user: str) -> UserView | None:
        """The user's view, asking the engines when none is known yet."""
        self.watch(user)
        known = self.views.get(user)
        if known is not None:
            return known
        pending = self._fetches.get(user)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_one(user))
            self._fetches[user] = pending
            pending.add_done_callback(lambda _: self._fetches.pop(user, None))
        try:
            return await asyncio.wait_for(asyncio.shield(pending), FETCH_TIMEOUT_S)
        except Exception:  # the headers go without it, never the response
            return None

    async def _fetch_one(self, user: str) -> UserView | None:
        views, _ = self._merge(await self._call(self._payload([user], False)))
        view = views.get(user)
        if view is not None:
            self.views.setdefault(user, view)
        return view

    async def run(self) -> None:
        """Refresh every REFRESH_S until cancelled; a failed round is logged
        once and retried (checks go on with the last answer)."""
        while True:
            try:
                await self.refresh()
                if self._failing:
                    logger.info("Admission: the engines answer again")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failing:
                    logger.warning("Admission: cannot read the engines' state: %s", exc)
                self._failing = True
            await asyncio.sleep(REFRESH_S)


def engine_call(engine_client: Any, method: str) -> Call:
    """Ask every engine behind ``engine_client`` (each data-parallel rank)."""
    core = engine_client.engine_core
    call_all = getattr(core, "call_utility_all_async", None)

    async def call(payload: dict[str, Any]) -> list[Any]:
        if call_all is not None:
            return list(await call_all(method, "admission", payload))
        return [await core.call_utility_async(method, "admission", payload)]

    return call


async def stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
