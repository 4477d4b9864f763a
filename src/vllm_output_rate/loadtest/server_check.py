"""Whether a server is there and serves the model, before a load starts.

``check_server`` is ``run_load``'s check on its own, for a caller that
starts several clients together and wants each window to open on time;
``list_models`` is what ``vllm-output-rate load`` shows when the model is
not given.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from vllm_output_rate.loadtest.errors import (
    LoadError,
    http_error_text,
    transport_detail,
)
from vllm_output_rate.loadtest.spec import (
    LoadSpec,
    any_api_key,
    bearer,
    normalize_base_url,
)

PREFLIGHT_TIMEOUT_S = 10.0


async def _get_models(
    client: httpx.AsyncClient,
    base_url: str,
    timeout_s: float,
    api_key: str | None = None,
) -> httpx.Response:
    """``GET /v1/models``; LoadError naming the URL if it cannot be reached."""
    try:
        return await client.get(
            "/v1/models", timeout=timeout_s, headers=bearer(api_key)
        )
    except httpx.TransportError as exc:
        raise LoadError(
            f"could not reach the vLLM server at {base_url}/v1/models "
            f"({type(exc).__name__}: {transport_detail(exc)}); "
            "is it running and is --base-url right?"
        ) from exc


async def preflight(
    client: httpx.AsyncClient,
    base_url: str,
    model: str | None,
    api_key: str | None = None,
) -> None:
    """Check that the server answers; if it lists models, that ``model`` is one.

    Raises LoadError naming the URL that could not be reached.
    """
    response = await _get_models(client, base_url, PREFLIGHT_TIMEOUT_S, api_key)
    if model is None or response.status_code != 200:
        return
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        ids = [m["id"] for m in response.json()["data"]]
        if ids and model not in ids:
            raise LoadError(
                f"model {model!r} is not served at {base_url}; it serves: "
                + ", ".join(ids)
            )


async def check_server(spec: LoadSpec) -> None:
    """``run_load``'s check of the server on its own (LoadError if it cannot
    be reached or does not serve ``spec.model``)."""
    base = normalize_base_url(spec.base_url)
    async with httpx.AsyncClient(base_url=base) as client:
        await preflight(client, base, spec.model, any_api_key(spec.api_keys))


async def list_models(
    base_url: str,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    api_key: str | None = None,
) -> list[str]:
    """Model ids from ``GET {base_url}/v1/models``; LoadError if unreachable
    (``api_key``: for a server that wants one on every route)."""
    base = normalize_base_url(base_url)
    url = f"{base}/v1/models"
    async with httpx.AsyncClient(base_url=base) as client:
        response = await _get_models(client, base, timeout_s, api_key)
    if response.status_code != 200:
        raise LoadError(
            f"{url} answered {http_error_text(response.status_code, response.content)}"
        )
    try:
        return [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"{url} returned an unexpected body: {exc}") from exc


def list_models_sync(
    base_url: str,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    api_key: str | None = None,
) -> list[str]:
    return asyncio.run(list_models(base_url, timeout_s, api_key))
