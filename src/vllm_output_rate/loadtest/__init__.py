"""Load tool: drive a vLLM OpenAI server with per-user load, measure each
user's output-token rate.

One or more *users* each run a number of concurrent *streams*.  A stream is a
loop: send one streaming request (completions or chat), consume it to the
end, send the next, until ``LoadSpec.duration_s`` has passed since the start.
A request in flight at the deadline is allowed to finish; no request is
started after it.  Users are named per request with
``vllm_xargs: {"output_rate_user": NAME}``; a user with ``name=None`` sends no
such field (the server's anonymous user).

Modules, in the order a run goes through them:

- ``spec``: what to run (``LoadSpec``, ``UserLoad``) and the request bodies;
- ``client``: the streaming HTTP client and the run loop (``run_load``);
- ``sse``: spec-compliant reading of the streamed responses (httpx-sse);
- ``summary``: what was measured (``RequestRecord``) and the pure
  summaries (rates, percentiles, 1-second bins, the bound check);
- ``results``: ``LoadResult``, which is also the JSON result file;
- ``report``: the text table and the rate chart (rich, matplotlib).

The names below are the package's public API (``from vllm_output_rate.loadtest
import LoadSpec, UserLoad, run_load_sync``); ``report`` is imported on its own,
since it pulls in the plotting library.

How tokens are counted
----------------------
By default each request asks for ``"return_token_ids": true`` (a vLLM
extension): every streamed choice then carries ``token_ids``, the exact delta
tokens, and the client counts ``len(token_ids)``.  This matters because vLLM
does *not* promise one token per chunk: when the API server's event loop falls
behind the engine it merges pending deltas into one chunk
(``RequestOutputCollector``), and a chunk can carry a token whose text is
still empty (an incomplete UTF-8 sequence held back by the detokenizer).
With ``return_token_ids=False`` the client falls back to one token per chunk
that has a choice (chat's initial role-only chunk excluded), which is exact
only while the server keeps up.  Either way the final usage chunk
(``stream_options.include_usage``) gives the server's ``completion_tokens``,
and the summaries report any request where the two disagree.

Measurement caveat
------------------
Times are taken on the client (``time.monotonic()``, in seconds since the run
started) when a chunk's SSE event is parsed, i.e. after the server's output
coalescing and HTTP/TCP buffering.  Long-run averages (the per-user rate over
its first-to-last-token span, the 1-second bins) are meaningful; individual
gaps between tokens are not.  See ``CAVEAT``.
"""

from vllm_output_rate.loadtest.client import (
    LoadError,
    ProgressSnapshot,
    list_models,
    list_models_sync,
    run_load,
    run_load_sync,
)
from vllm_output_rate.loadtest.results import LoadResult
from vllm_output_rate.loadtest.spec import DEFAULT_PROMPT, LoadSpec, UserLoad
from vllm_output_rate.loadtest.summary import CAVEAT, RequestRecord, UserSummary

__all__ = [
    "CAVEAT",
    "DEFAULT_PROMPT",
    "LoadError",
    "LoadResult",
    "LoadSpec",
    "ProgressSnapshot",
    "RequestRecord",
    "UserLoad",
    "UserSummary",
    "list_models",
    "list_models_sync",
    "run_load",
    "run_load_sync",
]
