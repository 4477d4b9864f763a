"""Load tool: drive a vLLM OpenAI server with per-user load, measure each
user's output-token rate.

One or more *users* each run concurrent *streams*; a stream sends one
streaming request (completions or chat), reads it to the end and sends the
next, until ``LoadSpec.duration_s`` has passed (a request in flight then
finishes; none starts after). A user is named per request with
``vllm_xargs: {"output_rate_user": NAME}`` (``name=None``: the anonymous
user). Tokens are counted from each chunk's ``token_ids``
(``return_token_ids``) and checked against the server's usage; times are
taken on the client, so long-run rates are meaningful, single gaps are not
(``CAVEAT``). Why: docs/architecture.md, "The load tool".

Modules, in the order a run goes through them: ``spec`` (what to run),
``server_check`` (is the server there, does it serve the model), ``client``
(the run loop; ``errors``: how it names failures), ``sse`` (reading the
streams), ``summary`` (pure per-user figures and the bound check),
``results`` (``LoadResult``, also the JSON file), ``report`` (table and
chart; imported on its own, since it pulls in matplotlib). The names
below are the public API
(``from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync``).
"""

from vllm_output_rate.loadtest.client import (
    ProgressSnapshot,
    run_load,
    run_load_sync,
)
from vllm_output_rate.loadtest.errors import LoadError
from vllm_output_rate.loadtest.results import LoadResult
from vllm_output_rate.loadtest.server_check import (
    check_server,
    list_models,
    list_models_sync,
)
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
    "check_server",
    "list_models",
    "list_models_sync",
    "run_load",
    "run_load_sync",
]
