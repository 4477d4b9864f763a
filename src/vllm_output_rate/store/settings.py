"""Settings of the shared budget store: URL, lease timing, fallback (no vLLM import).

A store is chosen with ``--output-rate-store URL`` (or ``store_url`` in the
limits file or ``additional_config``). Accepted schemes: ``redis://``,
``rediss://`` (TLS), ``valkey://``, ``valkeys://`` (the same protocol) and
``unix://`` (a socket path). The password comes from the URL or, when the
URL has none, from ``VLLM_OUTPUT_RATE_STORE_PASSWORD``; every message and
log line shows the URL with the password replaced by ``***``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from vllm_output_rate.validation import OutputRateConfigError

STORE_FLAG = "--output-rate-store"
STORE_REQUIRED_FLAG = "--output-rate-store-required"
FALLBACK_FLAG = "--output-rate-store-fallback-share"
PASSWORD_ENV = "VLLM_OUTPUT_RATE_STORE_PASSWORD"

# Keys of the ``output_rate`` section (additional_config) and the limits file.
STORE_URL_KEY = "store_url"
STORE_REQUIRED_KEY = "store_required"
FALLBACK_KEY = "store_fallback_share"
LEASE_KEY = "store_lease_s"
REFRESH_KEY = "store_refresh_s"
TIMEOUT_KEY = "store_timeout_s"
PREFIX_KEY = "store_key_prefix"
STORE_KEYS = (
    STORE_URL_KEY,
    STORE_REQUIRED_KEY,
    FALLBACK_KEY,
    LEASE_KEY,
    REFRESH_KEY,
    TIMEOUT_KEY,
    PREFIX_KEY,
)

SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "valkey": "redis",
    "valkeys": "rediss",
    "unix": "unix",
}


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise OutputRateConfigError(f"{STORE_FLAG}: malformed URL ({exc})") from None


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def check_store_url(url: object) -> str:
    """Return ``url`` if it names a Redis-compatible store we can talk to."""
    if not isinstance(url, str) or not url.strip():
        raise OutputRateConfigError(
            f"{STORE_FLAG}: expected a URL such as redis://HOST:6379/0, got {url!r}"
        )
    parts = _split(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise OutputRateConfigError(
            f"{STORE_FLAG} {redact_url(url)}: unsupported scheme {parts.scheme!r}; "
            f"expected one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme == "unix":
        if not parts.path:
            raise OutputRateConfigError(
                f"{STORE_FLAG} {redact_url(url)}: a unix:// URL needs a socket path, "
                "e.g. unix:///run/redis.sock"
            )
        return url
    if not parts.hostname:
        raise OutputRateConfigError(
            f"{STORE_FLAG} {redact_url(url)}: no host; expected e.g. "
            f"{scheme}://HOST:6379/0"
        )
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError:
        raise OutputRateConfigError(
            f"{STORE_FLAG} {redact_url(url)}: the port is not a number in 0-65535"
        ) from None
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        raise OutputRateConfigError(
            f"{STORE_FLAG} {redact_url(url)}: the database must be a number, "
            f"got {database!r}"
        )
    return url


def client_url(url: str) -> str:
    """The URL in the form redis-py accepts (valkey:// is the same protocol)."""
    scheme = _split(url).scheme
    return SCHEMES[scheme.lower()] + url[len(scheme) :]


def _positive(value: object, where: str, *, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OutputRateConfigError(f"{where}: expected a number, got {value!r}")
    number = float(value)
    if not number > 0 or (at_most is not None and number > at_most):
        bound = f" and at most {at_most:g}" if at_most is not None else ""
        raise OutputRateConfigError(f"{where}: must be > 0{bound}, got {value!r}")
    return number


@dataclass(frozen=True)
class StoreSettings:
    """Where the shared store is and how engines lease from it.

    * ``lease_s``: how long a lease holds without renewal; an engine that
      dies strands its leases for at most this long. Engines renew at half
      of it while they have demand.
    * ``refresh_s``: the refresher's cycle: heartbeat, new users, users
      contended with other engines, limit changes.
    * ``timeout_s``: the longest a store round trip may take; a slower one
      counts as a failure.
    * ``fallback_share``: the part of every limit an engine serves on its
      own while the store is unreachable; None: 1 / the number of engines it
      last saw sharing the store.
    """

    url: str
    required: bool = False
    fallback_share: float | None = None
    lease_s: float = 2.0
    refresh_s: float = 0.1
    timeout_s: float = 0.25
    key_prefix: str = "vllm-output-rate"

    def __post_init__(self) -> None:
        check_store_url(self.url)
        if self.fallback_share is not None:
            _positive(self.fallback_share, FALLBACK_FLAG, at_most=1.0)
        _positive(self.lease_s, LEASE_KEY)
        _positive(self.refresh_s, REFRESH_KEY)
        _positive(self.timeout_s, TIMEOUT_KEY)
        if not self.refresh_s * 2 <= self.lease_s:
            raise OutputRateConfigError(
                f"{REFRESH_KEY} ({self.refresh_s:g} s) must be at most half of "
                f"{LEASE_KEY} ({self.lease_s:g} s): leases are renewed before they "
                "expire"
            )
        if not isinstance(self.key_prefix, str) or not self.key_prefix:
            raise OutputRateConfigError(
                f"{PREFIX_KEY}: expected a non-empty string, got {self.key_prefix!r}"
            )

    @property
    def display_url(self) -> str:
        return redact_url(self.url)

    @property
    def password(self) -> str | None:
        """The URL's password, else the environment's (never logged)."""
        parts = _split(self.url)
        if parts.password is not None:
            return parts.password
        return os.environ.get(PASSWORD_ENV) or None

    def __repr__(self) -> str:  # never show the password
        return (
            f"StoreSettings(url={self.display_url!r}, required={self.required}, "
            f"fallback_share={self.fallback_share}, lease_s={self.lease_s}, "
            f"refresh_s={self.refresh_s}, timeout_s={self.timeout_s}, "
            f"key_prefix={self.key_prefix!r})"
        )

    def to_config(self) -> dict[str, Any]:
        return {
            STORE_URL_KEY: self.url,
            STORE_REQUIRED_KEY: self.required,
            FALLBACK_KEY: self.fallback_share,
            LEASE_KEY: self.lease_s,
            REFRESH_KEY: self.refresh_s,
            TIMEOUT_KEY: self.timeout_s,
            PREFIX_KEY: self.key_prefix,
        }

    @classmethod
    def from_config(
        cls, section: Mapping[str, Any], where: str
    ) -> StoreSettings | None:
        """The store part of a settings section; None when no URL is given.

        Options without a URL are refused: they would silently do nothing.
        """
        url = section.get(STORE_URL_KEY)
        given = [key for key in STORE_KEYS if section.get(key) is not None]
        if url is None:
            if [key for key in given if key != STORE_REQUIRED_KEY] or section.get(
                STORE_REQUIRED_KEY
            ):
                raise OutputRateConfigError(
                    f"{where}: {', '.join(given)} given without {STORE_URL_KEY} "
                    f"({STORE_FLAG})"
                )
            return None
        required = section.get(STORE_REQUIRED_KEY) or False
        if not isinstance(required, bool):
            raise OutputRateConfigError(
                f"{where}[{STORE_REQUIRED_KEY!r}]: expected true or false, "
                f"got {required!r}"
            )
        optional = {
            name: section[key]
            for name, key in (
                ("fallback_share", FALLBACK_KEY),
                ("lease_s", LEASE_KEY),
                ("refresh_s", REFRESH_KEY),
                ("timeout_s", TIMEOUT_KEY),
                ("key_prefix", PREFIX_KEY),
            )
            if section.get(key) is not None
        }
        return cls(url=check_store_url(url), required=required, **optional)
