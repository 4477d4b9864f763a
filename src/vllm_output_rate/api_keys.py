"""Trusted identity: API keys mapped to users, stored hashed (no vLLM import).

The keys file (YAML or JSON) maps each user to the SHA-256 digests of its
keys, never the keys themselves. A gateway's entry is a mapping whose
``gateway: true`` lets its keys name the end user of each request (by the
header or body fields the operator names, ``identity.py``)::

    user-a:
      - sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    user-b: [sha256:...]
    litellm:                 # charged itself when a request names no end user
      keys: [sha256:...]
      gateway: true

``vllm-output-rate hash-key`` prints the digest line for a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_output_rate.config import API_KEYS_FLAG
from vllm_output_rate.validation import OutputRateConfigError, validate_user_name

DIGEST_PREFIX = "sha256:"
ENTRY_KEYS = ("keys", "gateway")


def digest(key: str) -> str:
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who holds a key: its user and whether it may name other users."""

    user: str
    gateway: bool = False


class ApiKeys:
    def __init__(self, users_to_entries: Mapping[str, object], where: str) -> None:
        self._principal_of_digest: dict[str, Principal] = {}
        for user, entry in users_to_entries.items():
            validate_user_name(user, where)
            digests, gateway = _entry(entry, user, where)
            principal = Principal(user, gateway)
            for value in digests:
                if not (
                    isinstance(value, str)
                    and value.startswith(DIGEST_PREFIX)
                    and len(value) == len(DIGEST_PREFIX) + 64
                ):
                    raise OutputRateConfigError(
                        f"{where}: user {user!r} has an entry that is not "
                        f"'{DIGEST_PREFIX}<64 hex digits>'"
                    )
                stored = self._principal_of_digest.setdefault(value.lower(), principal)
                if stored != principal:
                    raise OutputRateConfigError(
                        f"{where}: one key digest is listed for two users"
                    )

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        where = f"{API_KEYS_FLAG} {path}"
        try:
            content = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise OutputRateConfigError(f"{where}: cannot read: {exc}") from None
        if not isinstance(content, Mapping) or not content:
            raise OutputRateConfigError(f"{where}: expected a mapping of users")
        return cls(content, where)

    @property
    def has_gateway(self) -> bool:
        return any(p.gateway for p in self._principal_of_digest.values())

    def principal_for(self, key: str) -> Principal | None:
        """Who owns ``key``, or None.

        Only digests are stored and looked up, so lookup timing reveals
        nothing usable about a key; the final comparison is constant-time.
        """
        candidate = digest(key)
        for stored, principal in self._principal_of_digest.items():
            if hmac.compare_digest(stored, candidate):
                return principal
        return None

    def user_for(self, key: str) -> str | None:
        principal = self.principal_for(key)
        return principal.user if principal is not None else None


def _entry(entry: object, user: str, where: str) -> tuple[list[object], bool]:
    """A user's digests and gateway mark, from a list or a mapping entry."""
    gateway: object = False
    if isinstance(entry, Mapping):
        unknown = set(entry) - set(ENTRY_KEYS)
        if unknown:
            raise OutputRateConfigError(
                f"{where}: user {user!r} has unknown keys {sorted(map(str, unknown))}"
                f"; expected {', '.join(ENTRY_KEYS)}"
            )
        gateway = entry.get("gateway", False)
        entry = entry.get("keys")
        if not isinstance(gateway, bool):
            raise OutputRateConfigError(
                f"{where}: user {user!r}: gateway must be true or false, "
                f"got {gateway!r}"
            )
    if not isinstance(entry, list) or not entry:
        raise OutputRateConfigError(
            f"{where}: user {user!r} needs a list of key digests"
        )
    return entry, bool(gateway)
