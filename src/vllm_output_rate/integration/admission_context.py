"""One HTTP request's admission: its context and the middleware.

``AdmissionMiddleware`` (pure ASGI) gives every HTTP request an
``AdmissionContext``, shared by reference with the tasks its handler
starts, and adds the admission headers to its response at the response's
start (for a stream, right after admission). ``note_checked_request`` puts
the API request vLLM just checked the model of into it, for the admission
check that follows (``admission.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_output_rate.integration.admission import Admission

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class AdmissionContext:
    """One HTTP request's admission (shared by reference with its tasks)."""

    request: Any = None  # the API request object, once its model was checked
    user: str | None = None  # whose caps it was checked against
    reserved: int = 0  # sequences reserved at the door, not yet registered
    registered: bool = False
    new_tokens: int = 0  # its max_tokens, while not yet in the engines' view
    refused: tuple[str, int] | None = None  # a 429's reason, requests held


current: ContextVar[AdmissionContext | None] = ContextVar(
    "output_rate_admission", default=None
)
# Set while a request this module admitted registers: vLLM's own second
# check then passes (its place is counted, as a reservation, until then).
admitted: ContextVar[bool] = ContextVar("output_rate_admitted", default=False)


def requested_tokens(request: Any) -> int:
    """The most output tokens an API request asks for, when it says."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(request, name, None)
        if isinstance(value, int) and value > 0:
            return value * max(1, int(getattr(request, "n", 1) or 1))
    params = getattr(request, "sampling_params", None)
    value = getattr(params, "max_tokens", None)
    return value if isinstance(value, int) and value > 0 else 0


class AdmissionMiddleware:
    """Gives every HTTP request an ``AdmissionContext`` and its response the
    admission headers (at its start: for a stream, at admission)."""

    def __init__(self, app: Any, holder: Any) -> None:
        self.app = app
        self._holder = holder  # has .admission: Admission | None (the plugin)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        admission: Admission | None = self._holder.admission
        if admission is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = AdmissionContext()
        token = current.set(context)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and context.user is not None:
                extra = await admission.headers(context)
                if extra:
                    message = {
                        **message,
                        "headers": [
                            *message.get("headers", []),
                            *((k.encode(), v.encode()) for k, v in extra.items()),
                        ],
                    }
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            current.reset(token)
            admission.end(context)


def note_checked_request(request: Any) -> None:
    """Called with each API request whose model vLLM just checked, right
    before its admission check (``seams.MODEL_CHECK``)."""
    context = current.get()
    if context is not None:
        context.request = request
        context.new_tokens = requested_tokens(request)
