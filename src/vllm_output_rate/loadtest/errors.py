"""How the load tool names what went wrong: ``LoadError`` and error texts."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx


class LoadError(RuntimeError):
    """The load could not be run at all (e.g. the server is unreachable)."""


def error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(payload)


def error_code(payload: dict[str, Any]) -> int | None:
    """vLLM's error body carries the HTTP status as ``error.code``."""
    err = payload.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else None


def http_error_text(status: int, raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").strip()
    with contextlib.suppress(ValueError):
        text = error_text(json.loads(text))
    if len(text) > 500:
        text = text[:500] + "..."
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def transport_detail(exc: httpx.TransportError) -> str:
    return str(exc) or type(exc).__name__
