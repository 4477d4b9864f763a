"""What a load run sends: the users, their streams, and the request bodies.

``LoadSpec`` names the server, the model and the users; ``UserLoad`` is one
user with its number of concurrent streams (and the limit the server is
expected to enforce, used only for the bound check).  ``build_request_body``
is the one place that turns a spec into the JSON body a stream sends.
Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

USER_FIELD = "output_rate_user"
ANONYMOUS_LABEL = "(anonymous)"
DEFAULT_PROMPT = (
    "Tell a long story about a train journey through the mountains, "
    "with many details about the passengers and the places they pass."
)

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}


def user_label(name: str | None) -> str:
    """How a user is shown in tables, plots and progress lines."""
    return ANONYMOUS_LABEL if name is None else name


@dataclass
class UserLoad:
    """One user: ``streams`` concurrent request loops under one name.

    ``name=None`` means requests carry no ``output_rate_user`` (anonymous).
    ``limit`` (tokens/s) is what the server is expected to enforce for this
    user; the client does not send it, it only uses it for the bound check.
    ``think_s``: each stream's pause after a completed request, as a person
    reading the answer takes (0: the next request at once).
    """

    name: str | None
    streams: int
    limit: float | None = None
    think_s: float = 0.0

    @property
    def label(self) -> str:
        return user_label(self.name)


@dataclass
class LoadSpec:
    """What to run.  ``base_url`` is the server root (a trailing ``/v1`` is
    accepted and ignored), e.g. ``http://127.0.0.1:8000``.

    ``extra_body`` is merged into every request body last (its
    ``vllm_xargs``, if any, is merged with the user's).  ``return_token_ids``
    asks vLLM for the token ids of each chunk, which makes the client's token
    count exact; see the package docstring.

    ``api_keys`` maps a user name to the API key its requests carry
    (``Authorization: Bearer KEY``), for a server with trusted identity
    (``--output-rate-api-keys``): there the key, not ``output_rate_user``,
    names the user. Keys are never written to the results.
    """

    base_url: str
    model: str
    users: list[UserLoad]
    max_tokens: int = 200
    duration_s: float = 20.0
    prompt: str = DEFAULT_PROMPT
    endpoint: Endpoint = "completions"
    ignore_eos: bool = True
    request_timeout_s: float = 300.0
    extra_body: dict[str, Any] | None = None
    return_token_ids: bool = True
    api_keys: dict[str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.base_url = str(self.base_url)
        self.users = list(self.users)
        if not self.users:
            raise ValueError("LoadSpec.users is empty")
        seen: set[str | None] = set()
        for user in self.users:
            _check_user(user)
            if user.name in seen:
                raise ValueError(f"user {user.label} is listed twice")
            seen.add(user.name)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(
                f"request_timeout_s must be > 0, got {self.request_timeout_s}"
            )
        unknown = sorted(set(self.api_keys or {}) - {u.name for u in self.users})
        if unknown:
            raise ValueError(f"api_keys names users not in the load: {unknown}")
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(
                f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, "
                f"got {self.endpoint!r}"
            )


def _check_user(user: UserLoad) -> None:
    if user.name is not None and (not isinstance(user.name, str) or not user.name):
        raise ValueError(
            f"user name must be a non-empty string or None, got {user.name!r}"
        )
    if int(user.streams) != user.streams or user.streams < 1:
        raise ValueError(
            f"user {user.label}: streams must be an integer >= 1, got {user.streams!r}"
        )
    if user.limit is not None and not (math.isfinite(user.limit) and user.limit > 0):
        raise ValueError(
            f"user {user.label}: limit must be > 0 tokens/s, got {user.limit!r}"
        )
    if not (math.isfinite(user.think_s) and user.think_s >= 0):
        raise ValueError(
            f"user {user.label}: think_s must be >= 0 seconds, got {user.think_s!r}"
        )


def normalize_base_url(base_url: str) -> str:
    """``http://h:8000/``, ``http://h:8000/v1`` -> ``http://h:8000``."""
    url = base_url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that carries ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_headers(spec: LoadSpec, user: UserLoad) -> dict[str, str]:
    """The HTTP headers of every request a stream of ``user`` sends."""
    keys = spec.api_keys or {}
    return bearer(keys.get(user.name) if user.name is not None else None)


def any_api_key(api_keys: Mapping[str, str] | None) -> str | None:
    """A key for the server's non-generating routes (the model list)."""
    return next(iter((api_keys or {}).values()), None)


def build_request_body(spec: LoadSpec, user: UserLoad) -> dict[str, Any]:
    """The JSON body of every request a stream of ``user`` sends (pure)."""
    body: dict[str, Any] = {"model": spec.model}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(
        {
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": spec.ignore_eos,
        }
    )
    if spec.return_token_ids:
        body["return_token_ids"] = True
    extra = dict(spec.extra_body or {})
    xargs = dict(extra.pop("vllm_xargs", None) or {})
    body.update(extra)
    if user.name is not None:
        xargs[USER_FIELD] = user.name
    if xargs:
        body["vllm_xargs"] = xargs
    return body
