"""Wiring admission into the HTTP plugin (API server side).

``start_admission`` builds the ``Admission`` of this API server process,
installs it on the engine client and the hook that hands it each API
request, and starts its background tasks (the engines' view, old rejection
counts). ``check_limits_update`` validates an admin change's caps beside
its limits, and ``with_rejections`` adds each user's refusals (this API
server's) to a page of the stats route.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_output_rate import seams
from vllm_output_rate.admission_caps import (
    GlobalCaps,
    admission_part,
    caps_from_document,
    without_admission_keys,
)
from vllm_output_rate.integration import admission, engine_setup
from vllm_output_rate.integration.admission_context import note_checked_request
from vllm_output_rate.integration.admission_view import EngineViews, engine_call
from vllm_output_rate.limits_update import PROMPT_OFF, parse_limits_update
from vllm_output_rate.validation import OutputRateConfigError

_hooked = False


def start_admission(
    engine_client: Any,
) -> tuple[admission.Admission | None, list[asyncio.Task[None]]]:
    """Admission on ``engine_client`` (None: not vLLM's ``AsyncLLM``, whose
    admission check this replaces)."""
    module, name = seams.ENGINE_CLIENT
    if not isinstance(engine_client, seams.resolve(module, name)):
        return None, []
    install_model_check_hook()
    core = engine_client.engine_core
    views = EngineViews(
        engine_call(engine_client, seams.RPC_METHOD),
        client=int(getattr(core, "client_index", 0)),
        others=int(getattr(core, "client_count", 1)) > 1,
    )
    checker = admission.Admission(engine_client, views)
    views.local_users = checker.ledger.live_users
    admission.install(engine_client, checker)
    tasks = [
        asyncio.create_task(views.run()),
        asyncio.create_task(admission.forget_old_rejections(checker)),
    ]
    return checker, tasks


def install_model_check_hook() -> None:
    """Hand each API request to admission right after vLLM checked its model
    (``seams.MODEL_CHECK``): the admission check follows in every generating
    route, before rendering."""
    global _hooked
    if _hooked:
        return
    from vllm_output_rate.integration.plugin import wrap

    module, path = seams.MODEL_CHECK
    owner, method = path.split(".")

    def make(original: Any) -> Any:
        async def check_model(
            self: Any, request: Any, *args: Any, **kwargs: Any
        ) -> Any:
            result = await original(self, request, *args, **kwargs)
            note_checked_request(request)
            return result

        return check_model

    wrap(seams.resolve(module, owner), method, make)
    _hooked = True


def check_limits_update(payload: object, plugin: Any) -> None:
    """Refuse a bad admin change before it reaches the engine: its limits,
    weights and floors, and its admission caps (against vLLM's own caps)."""
    if not isinstance(payload, dict):
        parse_limits_update(payload)  # raises, naming the body
        return
    update = parse_limits_update(without_admission_keys(payload))
    if update.changes_prompt_rates and not engine_setup.prompt_limiting_enabled:
        raise OutputRateConfigError(PROMPT_OFF)
    checker: admission.Admission | None = getattr(plugin, "admission", None)
    global_caps = checker.global_caps if checker is not None else GlobalCaps()
    caps_from_document(admission_part(payload), global_caps, "request body")


def with_rejections(page: dict[str, Any], plugin: Any) -> dict[str, Any]:
    """A stats page with each user's refusals by this API server, by reason
    (``rejections``; {} when none)."""
    checker: admission.Admission | None = getattr(plugin, "admission", None)
    by_user = checker.by_user if checker is not None else {}
    for user, view in page.get("users", {}).items():
        counts, _ = by_user.get(user, ({}, 0.0))
        view["rejections"] = dict(counts)
    return page
