"""The engine's side of admission: the caps in force, and its users' state.

Caps live in the engine, beside the limits, so that every API server
process and every change path (flags, limits file, admin API) sees one set:
``CapsHolder`` keeps them, reloads the admission keys of the limits file
when it changes (at most once a second) and counts versions, so that an API
server fetches the caps only when they changed.

``admission_view`` answers the API server's periodic question (operator
channel op ``"admission"``): for each user it asks about, and with several
API servers also for each user with requests from the others, the user's
limit, the rate this engine serves it at, its GCRA wait, its unfinished
requests here and the tokens they may still take. One pass over the
scheduler's requests per call; the API servers call at most every 0.1 s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from vllm_output_rate.admission_caps import (
    ADMISSION_KEYS,
    Caps,
    GlobalCaps,
    admission_part,
    caps_from_document,
    without_admission_keys,
)
from vllm_output_rate.config import ADDITIONAL_CONFIG_KEY, FILE_KEY
from vllm_output_rate.limits_update import REMOVE_KEY
from vllm_output_rate.scheduling.demand import USER_ATTR
from vllm_output_rate.validation import OutputRateConfigError

logger = logging.getLogger("vllm.output_rate")
FILE_CHECK_INTERVAL_S = 1.0
HOLDER_ATTR = "output_rate_admission_caps"
NS = 1e9


class CapsHolder:
    """The per-user caps in force in this engine."""

    def __init__(
        self,
        caps: Caps,
        global_caps: GlobalCaps,
        config_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.caps = caps
        self.global_caps = global_caps
        self.version = 1
        self._file = config_file
        self._clock = clock
        self._next_check = clock() + FILE_CHECK_INTERVAL_S
        self._mtime = self._read_mtime()
        self._file_users = self._load_file_users()

    @classmethod
    def from_config(
        cls, section: dict[str, Any], global_caps: GlobalCaps
    ) -> CapsHolder:
        """The caps of ``additional_config['output_rate']`` (where the flags
        and the limits file were merged at start-up)."""
        where = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
        caps = caps_from_document(admission_part(section), global_caps, where)
        return cls(caps, global_caps, section.get(FILE_KEY))

    def _read_mtime(self) -> int | None:
        try:
            return None if self._file is None else os.stat(self._file).st_mtime_ns
        except OSError:
            return None

    def _load_file(self) -> dict[str, Any] | None:
        if self._file is None:
            return None
        try:
            content = yaml.safe_load(Path(self._file).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            logger.warning("limits file caps not reloaded: %s", exc)
            return None
        return admission_part(content) if isinstance(content, dict) else {}

    def _load_file_users(self) -> set[str]:
        document = self._load_file() or {}
        users: set[str] = set()
        for key in ADMISSION_KEYS:
            if isinstance(document.get(key), dict):
                users |= set(document[key])
        return users

    def poll_file(self) -> None:
        """Apply the file's caps if it changed since the last look (its
        users' caps and its defaults replace those in force; users that left
        it fall back to the default). A bad file is logged and ignored."""
        now = self._clock()
        if self._file is None or now < self._next_check:
            return
        self._next_check = now + FILE_CHECK_INTERVAL_S
        mtime = self._read_mtime()
        if mtime is None or mtime == self._mtime:
            return
        self._mtime = mtime
        document = self._load_file()
        if document is None:
            return
        try:
            users = {
                user
                for key in ADMISSION_KEYS
                if isinstance(document.get(key), dict)
                for user in document[key]
            }
            self.caps = self.caps.updated(
                document,
                self.global_caps,
                f"limits file {self._file}",
                remove_users=self._file_users - users,
            )
        except OutputRateConfigError as exc:
            logger.warning("limits file caps not reloaded: %s", exc)
            return
        self._file_users = users
        self.version += 1

    def update(self, body: dict[str, Any]) -> Caps:
        """The caps an admin change would make (validated, not applied)."""
        remove = body.get(REMOVE_KEY) or []
        return self.caps.updated(
            admission_part(body),
            self.global_caps,
            "request body",
            remove_users=remove if isinstance(remove, list) else [],
        )

    def apply(self, caps: Caps) -> None:
        if caps != self.caps:
            self.caps = caps
            self.version += 1


def caps_holder(engine_core: Any) -> CapsHolder:
    """This engine's holder, made on first use from its configuration."""
    holder: CapsHolder | None = getattr(engine_core, HOLDER_ATTR, None)
    if holder is None:
        config = engine_core.vllm_config
        section = (config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        holder = CapsHolder.from_config(section, global_caps_of(config))
        setattr(engine_core, HOLDER_ATTR, holder)
    return holder


def global_caps_of(vllm_config: Any) -> GlobalCaps:
    scheduler_config = vllm_config.scheduler_config
    return GlobalCaps(
        requests=scheduler_config.max_num_queued_reqs,
        tokens=scheduler_config.max_num_queued_tokens,
    )


def admission_view(engine_core: Any, policy: Any, payload: dict[str, Any]) -> Any:
    """Users' state for the API server ``payload["client"]`` (see the module
    docstring); the caps too when its ``caps_version`` is not the current."""
    holder = caps_holder(engine_core)
    holder.poll_file()
    wanted = set(payload.get("users") or ())
    client = payload.get("client", 0)
    others = bool(payload.get("others"))
    # user -> [requests here, tokens they may take, fewest remaining, elsewhere]
    counts: dict[str, list[int]] = {}
    requests = engine_core.scheduler.requests
    if wanted or others:
        for request in requests.values():
            user = getattr(request, USER_ATTR, None)
            if user is None or (user not in wanted and not others):
                continue
            row = counts.get(user)
            if row is None:
                row = counts[user] = [0, 0, 1 << 62, 0]
            remaining = max(0, request.max_tokens - request.num_output_tokens)
            row[0] += 1
            row[1] += remaining
            row[2] = min(row[2], remaining)
            if request.client_index != client:
                row[3] += 1
    if others:
        counts = {u: row for u, row in counts.items() if row[3] or u in wanted}
    limiter = policy.limiter
    leases = getattr(policy, "leases", None)
    labels = policy.stats.labels
    users = {}
    for user in wanted | counts.keys():
        limit = limiter.rate_of(user)
        share = leases.lease_rate(user) if leases is not None else None
        here, outstanding, fewest, elsewhere = counts.get(user, (0, 0, 0, 0))
        # ready_at_ns is its own clock reading when the user may take now:
        # the clock read after it tells a wait from none.
        ready = limiter.ready_at_ns(user)
        users[user] = [
            limit,
            limit if share is None else share,
            max(0, ready - limiter.now_ns()) / NS,
            here,
            outstanding,
            fewest if here else 0,
            labels.current_label(user),
            elsewhere,
        ]
    answer: dict[str, Any] = {"users": users, "caps_version": holder.version}
    if payload.get("caps_version") != holder.version:
        answer["caps"] = holder.caps.to_document()
        answer["global_caps"] = [holder.global_caps.requests, holder.global_caps.tokens]
    return answer


def limits_page(engine_core: Any, policy: Any, page: dict[str, Any]) -> Any:
    """A page of the limits document, with the admission caps of its users
    (users with caps of their own are paged like those with a limit)."""
    holder = caps_holder(engine_core)
    holder.poll_file()
    answer = policy.limits_page(
        page["limit"], page.get("after"), extra_users=holder.caps.users
    )
    answer["limits"].update(holder.caps.page(answer.pop("names", ())))
    return answer


def update_limits(engine_core: Any, policy: Any, body: dict[str, Any]) -> None:
    """An admin change: limits, weights and floors to the policy, caps to the
    holder; all or nothing (both are validated before either applies)."""
    holder = caps_holder(engine_core)
    caps = holder.update(body)
    rest = without_admission_keys(body)
    if rest:
        policy.update_limits(rest)
    holder.apply(caps)
