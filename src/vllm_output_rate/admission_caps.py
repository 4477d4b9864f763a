"""Per-user admission caps, Retry-After and rate-limit headers (no vLLM import).

The contract, in the API server's terms:

* ``Caps``: each user's cap on concurrent requests (sequences: ``n`` counts
  ``n``) and on queued prompt tokens (prompt tokens of its requests still
  waiting for their first token), a default and per-user values; None is no
  cap. Validated whole numbers >= 1, never above vLLM's own global cap.
* ``refusal``: whether a request of ``n`` sequences is the user's own excess
  (HTTP 429, or 400 when ``n`` alone is above the cap and no retry can help).
* ``UserView``: what the engines last said of a user (limit, its GCRA wait,
  its requests and the tokens they may still take); ``retry_after_s`` and
  ``rate_limit_headers`` derive the 429's ``Retry-After`` and the
  ``x-ratelimit-*`` headers from it. Their exact meaning is written down in
  docs/operations.md ("Admission").

Pure arithmetic: the caller supplies counts and views; nothing here reads a
clock or the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_output_rate.validation import OutputRateConfigError, validate_user_name

# Keys of the limits document (flags, limits file, additional_config, admin).
DEFAULT_REQUESTS_KEY = "default_user_max_concurrent_requests"
REQUESTS_KEY = "user_max_concurrent_requests"
DEFAULT_TOKENS_KEY = "default_user_max_queued_prompt_tokens"
TOKENS_KEY = "user_max_queued_prompt_tokens"
ADMISSION_KEYS = (DEFAULT_REQUESTS_KEY, REQUESTS_KEY, DEFAULT_TOKENS_KEY, TOKENS_KEY)
DEFAULT_REQUESTS_FLAG = "--default-user-max-concurrent-requests"
REQUESTS_FLAG = "--user-max-concurrent-requests"
DEFAULT_TOKENS_FLAG = "--default-user-max-queued-prompt-tokens"
TOKENS_FLAG = "--user-max-queued-prompt-tokens"
GLOBAL_REQUESTS_FLAG = "--max-num-queued-reqs"
GLOBAL_TOKENS_FLAG = "--max-num-queued-tokens"

# Refusal reasons (the metrics' ``reason`` label). vLLM's own global caps
# keep vLLM's names.
OWN_REQUESTS = "user_max_concurrent_requests"
OWN_TOKENS = "user_max_queued_prompt_tokens"
GLOBAL_REQUESTS = "max_num_queued_reqs"
GLOBAL_TOKENS = "max_num_queued_tokens"
REASONS = (OWN_REQUESTS, OWN_TOKENS, GLOBAL_REQUESTS, GLOBAL_TOKENS)

# The window of the x-ratelimit-*-tokens headers: OpenAI's, one minute.
TOKEN_WINDOW_S = 60.0
# Retry-After: never below this (a retry sooner would find the same state),
# plus this part of the estimate, for what the estimate cannot see.
MIN_RETRY_S = 0.5
RETRY_MARGIN = 0.1


def validate_cap(
    value: object, where: str, ceiling: int | None = None, ceiling_name: str = ""
) -> int:
    """``value`` if it is a whole number >= 1 and at most ``ceiling``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OutputRateConfigError(
            f"{where} must be a whole number >= 1, got {value!r}"
        )
    if ceiling is not None and value > ceiling:
        raise OutputRateConfigError(
            f"{where} ({value}) is above the server's own cap {ceiling_name} "
            f"{ceiling}: it could never be reached"
        )
    return value


def parse_user_caps(
    value: object, where: str, ceiling: int | None = None, ceiling_name: str = ""
) -> dict[str, int]:
    """A JSON object (or its text) of user name to cap, validated."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise OutputRateConfigError(
                f"{where}: not valid JSON ({exc.msg} at character {exc.pos}): {value!r}"
            ) from None
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{where}: expected a JSON object of user name to a whole number, "
            f"got {value!r}"
        )
    return {
        validate_user_name(user, where): validate_cap(
            cap, f"{where}: cap of user {user!r}", ceiling, ceiling_name
        )
        for user, cap in value.items()
    }


@dataclass(frozen=True)
class GlobalCaps:
    """vLLM's own caps of this server (None: not set)."""

    requests: int | None = None  # --max-num-queued-reqs
    tokens: int | None = None  # --max-num-queued-tokens


@dataclass(frozen=True)
class Caps:
    """Per-user caps as configured (None: no default of its own)."""

    default_requests: int | None = None
    requests: Mapping[str, int] = field(default_factory=dict)
    default_tokens: int | None = None
    tokens: Mapping[str, int] = field(default_factory=dict)

    def requests_of(self, user: str, global_caps: GlobalCaps) -> int | None:
        """The user's cap on concurrent requests; without a default of its
        own, vLLM's global cap (so that a user alone may use the whole
        server, while its paused requests cannot fill it for others)."""
        cap = self.requests.get(user, self.default_requests)
        return global_caps.requests if cap is None else cap

    def tokens_of(self, user: str, global_caps: GlobalCaps) -> int | None:
        cap = self.tokens.get(user, self.default_tokens)
        return global_caps.tokens if cap is None else cap

    @property
    def users(self) -> set[str]:
        return set(self.requests) | set(self.tokens)

    def is_empty(self) -> bool:
        return not (
            self.requests or self.tokens or self.default_requests or self.default_tokens
        )

    def to_document(self) -> dict[str, Any]:
        return {
            DEFAULT_REQUESTS_KEY: self.default_requests,
            REQUESTS_KEY: dict(self.requests),
            DEFAULT_TOKENS_KEY: self.default_tokens,
            TOKENS_KEY: dict(self.tokens),
        }

    def page(self, users: Iterable[str]) -> dict[str, Any]:
        """The document restricted to ``users`` (one page of the limits)."""
        names = list(users)
        return {
            DEFAULT_REQUESTS_KEY: self.default_requests,
            REQUESTS_KEY: {u: self.requests[u] for u in names if u in self.requests},
            DEFAULT_TOKENS_KEY: self.default_tokens,
            TOKENS_KEY: {u: self.tokens[u] for u in names if u in self.tokens},
        }

    def updated(
        self,
        document: Mapping[str, Any],
        global_caps: GlobalCaps,
        where: str = "",
        remove_users: Iterable[str] = (),
    ) -> Caps:
        """These caps with the admission keys of ``document`` applied (a
        missing key keeps its value; ``remove_users`` drop their own caps).
        Raises OutputRateConfigError, naming the key, on bad input."""
        prefix = f"{where}: " if where else ""

        def default(key: str, ceiling: int | None, flag: str) -> int | None:
            value = document.get(key)
            if value is None:
                return None
            return validate_cap(value, f"{prefix}{key}", ceiling, flag)

        requests = dict(self.requests)
        tokens = dict(self.tokens)
        for user in remove_users:
            requests.pop(user, None)
            tokens.pop(user, None)
        requests.update(
            parse_user_caps(
                document.get(REQUESTS_KEY) or {},
                f"{prefix}{REQUESTS_KEY}",
                global_caps.requests,
                GLOBAL_REQUESTS_FLAG,
            )
        )
        tokens.update(
            parse_user_caps(
                document.get(TOKENS_KEY) or {},
                f"{prefix}{TOKENS_KEY}",
                global_caps.tokens,
                GLOBAL_TOKENS_FLAG,
            )
        )
        new_requests = default(
            DEFAULT_REQUESTS_KEY, global_caps.requests, GLOBAL_REQUESTS_FLAG
        )
        new_tokens = default(DEFAULT_TOKENS_KEY, global_caps.tokens, GLOBAL_TOKENS_FLAG)
        return replace(
            self,
            default_requests=self.default_requests
            if new_requests is None
            else new_requests,
            requests=requests,
            default_tokens=self.default_tokens if new_tokens is None else new_tokens,
            tokens=tokens,
        )


def caps_from_document(
    document: Mapping[str, Any] | None, global_caps: GlobalCaps, where: str = ""
) -> Caps:
    """Caps from the admission keys of a limits document (others ignored)."""
    return Caps().updated(document or {}, global_caps, where)


def admission_part(document: Mapping[str, Any]) -> dict[str, Any]:
    """The admission keys of a document (an admin change, a limits file)."""
    return {key: document[key] for key in ADMISSION_KEYS if key in document}


def without_admission_keys(document: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in document.items() if key not in ADMISSION_KEYS}


# ----- refusing a user's own excess -----------------------------------------


@dataclass(frozen=True)
class Refusal:
    status: int  # 429: the user's own excess; 400: no retry can help
    reason: str
    message: str


def refusal(
    n: int,
    requests_cap: int | None,
    tokens_cap: int | None,
    own_requests: int,
    own_queued_tokens: int,
) -> Refusal | None:
    """Whether a request of ``n`` sequences is refused by the user's caps.

    ``own_requests`` and ``own_queued_tokens`` are what the user holds now.
    As vLLM's global token cap, the token cap refuses once the user's queued
    prompt tokens have reached it (a single long prompt is admitted when the
    user has nothing queued).
    """
    if requests_cap is not None and n > requests_cap:
        return Refusal(
            400,
            OWN_REQUESTS,
            f"n={n} asks for more concurrent sequences than this user's cap "
            f"of {requests_cap}",
        )
    if requests_cap is not None and own_requests + n > requests_cap:
        return Refusal(
            429,
            OWN_REQUESTS,
            f"This user has {own_requests} requests in flight; its cap is "
            f"{requests_cap} concurrent requests. Retry after the time in the "
            "Retry-After header.",
        )
    if tokens_cap is not None and own_queued_tokens >= tokens_cap:
        return Refusal(
            429,
            OWN_TOKENS,
            f"This user has {own_queued_tokens} prompt tokens waiting for their "
            f"first token; its cap is {tokens_cap}. Retry after the time in the "
            "Retry-After header.",
        )
    return None


# ----- what the engines say of a user, and the headers -----------------------


@dataclass(frozen=True)
class UserView:
    """A user as the engines last saw it (summed over data-parallel ranks)."""

    limit: float  # tok/s, the user's limit
    rate: float  # tok/s the engines serve it at now (their shares of the limit)
    wait_s: float = 0.0  # until the next token may be sent (GCRA); 0: now
    requests: int = 0  # its unfinished requests in the engines
    outstanding: int = 0  # tokens they may still take (max_tokens - output)
    min_remaining: int = 0  # the fewest any one of them may still take
    label: str = ""  # its metrics label

    @property
    def paused(self) -> bool:
        """Held back by its own limit: its next token is not due yet."""
        return self.wait_s > 0


def retry_after_s(
    view: UserView | None, reason: str, own_requests: int, assumed_remaining: int = 0
) -> float:
    """When the user's own excess is expected to be gone.

    Concurrent requests: when its first request finishes, its ``k`` requests
    taking turns at its rate (``wait + k x fewest remaining / rate``; while
    the engines have not seen its requests yet, each is assumed to be as
    long as ``assumed_remaining``, the refused request's own). Queued prompt
    tokens: one round of turns (``wait + k / rate``), after which its oldest
    waiting request has its first token. Exact while the user runs at its
    limit; when the engine is slower than the limit, the requests take
    longer and a retry may be refused again, with a later estimate. Never
    below MIN_RETRY_S.
    """
    if view is None or view.rate <= 0:
        return MIN_RETRY_S
    turns = max(view.requests, own_requests, 1)
    if reason == OWN_REQUESTS:
        remaining = view.min_remaining if view.requests else assumed_remaining
        estimate = view.wait_s + turns * max(remaining, 1) / view.rate
    else:
        estimate = view.wait_s + turns / view.rate
    return max(MIN_RETRY_S, estimate * (1 + RETRY_MARGIN))


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes its reset headers: 17ms, 1.5s, 6m0s."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms_left = divmod(ms, 60_000)
    secs = f"{ms_left / 1000:.3f}".rstrip("0").rstrip(".")
    if not minutes:
        return f"{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"


def retry_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``."""
    return {
        "retry-after": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000))),
    }


def rate_limit_headers(
    view: UserView,
    *,
    new_tokens: int = 0,
    requests_cap: int | None = None,
    own_requests: int = 0,
    requests_reset_s: float = 0.0,
) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of one response (see docs/operations.md).

    Tokens are per minute: ``limit`` is 60 x the user's tok/s; ``remaining``
    what it may still be sent in the coming minute beyond what it already
    owes (its requests' remaining ``max_tokens``, ``new_tokens`` of this
    request if not yet counted, and its GCRA wait); ``reset`` when what it
    owes is paid at its limit. Requests: the concurrent-request cap, what is
    left of it after this request, and (at 0 left) when a slot is expected.
    """
    owed = view.outstanding + new_tokens + view.wait_s * view.limit
    per_window = view.limit * TOKEN_WINDOW_S
    headers = {
        "x-ratelimit-limit-tokens": str(max(1, math.floor(per_window))),
        "x-ratelimit-remaining-tokens": str(max(0, math.floor(per_window - owed))),
        "x-ratelimit-reset-tokens": format_duration(owed / view.limit),
    }
    if requests_cap is not None:
        left = max(0, requests_cap - own_requests)
        headers["x-ratelimit-limit-requests"] = str(requests_cap)
        headers["x-ratelimit-remaining-requests"] = str(left)
        headers["x-ratelimit-reset-requests"] = format_duration(
            requests_reset_s if left == 0 else 0.0
        )
    return headers


def merge_views(views: Iterable[UserView]) -> UserView | None:
    """One user's views from several engines (data-parallel ranks) as one:
    its requests and shares add up; it is paused only where every engine
    holding it back agrees (the shortest wait)."""
    views = list(views)
    if not views:
        return None
    if len(views) == 1:
        return views[0]
    holding = [v for v in views if v.requests] or views
    remaining = [v.min_remaining for v in holding if v.requests]
    return UserView(
        limit=max(v.limit for v in views),
        rate=min(max(v.limit for v in views), sum(v.rate for v in holding)),
        wait_s=min(v.wait_s for v in holding),
        requests=sum(v.requests for v in views),
        outstanding=sum(v.outstanding for v in views),
        min_remaining=min(remaining) if remaining else 0,
        label=next((v.label for v in views if v.label), ""),
    )
