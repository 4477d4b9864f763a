"""Reading a streamed (server-sent events) HTTP response, as the SSE spec says.

Every place in this project that reads an SSE stream (the load tool, the
benchmarks, the end-to-end tests) goes through ``sse_data``.

Why not ``httpx.Response.aiter_lines()``: in an event stream, lines end only
at CR, LF or CRLF (WHATWG HTML, "Parsing an event stream").  httpx's
``aiter_lines()`` follows ``str.splitlines()`` and also ends lines at U+2028,
U+2029, U+0085, U+000B, U+000C and U+001C-U+001E.  JSON escapes the ASCII
ones but leaves U+0085, U+2028 and U+2029 as they are inside strings, and
vLLM's chunks carry the model's text as JSON strings: a chunk whose text
holds one of them is cut in two, and neither half parses.

The parsing is httpx-sse's (``EventSource``; from 0.4.3 its line decoder
splits on CR/LF/CRLF only): a small, typed, maintained library built on the
httpx client already used here, rather than a hand-written parser.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from httpx_sse import EventSource

# The characters str.splitlines() (and so httpx's aiter_lines()) ends lines
# at, besides CR and LF; none of them ends a line of an event stream.
UNICODE_LINE_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` of each event of ``response``, in order.

    Multi-line ``data:`` fields are joined with newlines; comments and other
    fields (``event:``, ``id:``, ``retry:``) are ignored, and so are events
    without data (the spec does not dispatch them).  An event cut off by the
    end of the stream (no blank line after it) is dropped, as the spec says.
    Raises ``httpx_sse.SSEError`` (an ``httpx.TransportError``) when the
    response is not ``text/event-stream``.
    """
    async for event in EventSource(response).aiter_sse():
        if event.data:
            yield event.data
