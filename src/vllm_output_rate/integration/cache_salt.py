"""Per-user prefix-cache isolation: each request's ``cache_salt`` from its user.

vLLM's prefix cache lets a request reuse the KV blocks another computed for
the same prompt prefix, which a tenant can detect by timing (CVE-2025-46570).
vLLM mixes a request's ``cache_salt`` into the hash of its first block (and
so of every block after it). With ``--output-rate-cache-salt user`` the
engine client funnel (trusted_identity.py) sets it from the request's user,
replacing any salt the client sent: requests of different users never share
a cached block, those of one user still do. The salt is a digest of the
user's name, the same in every API server and engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from vllm_output_rate.identity import Identity
from vllm_output_rate.integration.identity_flags import CACHE_SALT_FLAG

SALT_PREFIX = "output-rate-"


def salt_for(identity: Identity) -> str:
    """At most 128 characters, none of vLLM's forbidden ones (``@/\\``, NUL)."""
    return SALT_PREFIX + hashlib.sha256(identity.user.encode()).hexdigest()


def salted(prompt: Any, salt: str) -> Any:
    """A prompt of the funnel (``AsyncLLM.add_request``) with ``salt`` as its
    ``cache_salt``: an ``EngineCoreRequest`` is changed in place, a rendered
    or raw prompt is copied. A prompt it cannot salt is refused (HTTP 400)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine import EngineCoreRequest

    if isinstance(prompt, EngineCoreRequest):
        prompt.cache_salt = salt
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt, "cache_salt": salt}
    # Encoder-decoder prompts (refused at start-up with limiting on) keep
    # their salt elsewhere: refused rather than passed unsalted.
    if (
        isinstance(prompt, Mapping)
        and prompt.get("type") != "enc_dec"
        and "encoder_prompt" not in prompt
    ):
        return {**prompt, "cache_salt": salt}
    raise VLLMValidationError(
        f"{CACHE_SALT_FLAG}: cannot isolate the prefix cache of a "
        f"{type(prompt).__name__} prompt",
        parameter="cache_salt",
    )
