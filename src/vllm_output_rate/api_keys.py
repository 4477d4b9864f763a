"""Trusted identity: API keys mapped to users, stored hashed (no vLLM import).

The keys file (YAML or JSON) maps each user to the SHA-256 digests of its
keys, never the keys themselves::

    user-a:
      - sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    user-b: [sha256:...]

``vllm-output-rate hash-key`` prints the digest line for a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path

import yaml

from vllm_output_rate.config import API_KEYS_FLAG
from vllm_output_rate.validation import OutputRateConfigError, validate_user_name

DIGEST_PREFIX = "sha256:"


def digest(key: str) -> str:
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    def __init__(self, users_to_digests: Mapping[str, list[str]], where: str) -> None:
        self._user_of_digest: dict[str, str] = {}
        for user, digests in users_to_digests.items():
            validate_user_name(user, where)
            if not isinstance(digests, list) or not digests:
                raise OutputRateConfigError(
                    f"{where}: user {user!r} needs a list of key digests"
                )
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
                if self._user_of_digest.setdefault(value.lower(), user) != user:
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

    def user_for(self, key: str) -> str | None:
        """The user owning ``key``, or None.

        Only digests are stored and looked up, so lookup timing reveals
        nothing usable about a key; the final comparison is constant-time.
        """
        candidate = digest(key)
        for stored, user in self._user_of_digest.items():
            if hmac.compare_digest(stored, candidate):
                return user
        return None
