"""What one server's engine did during a run, from vLLM's own ``/metrics``.

``read_tally(url)`` reads vLLM's counters of finished requests and of prompt
and output tokens; ``after - before`` (a reading before the clients start,
one after they all returned) is what that engine did in the run, on stock
vLLM and with limits alike. The demo prints it beside the clients' figures
and checks it against them (``unseen_answers``): an answer the engine did
not give came from somewhere else, and a run measured there says nothing
about this server. Reading ``/metrics`` is fast while the server is idle,
which it is at both readings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# vLLM's counter families (their names without the "_total" suffix).
FINISHED = "vllm:request_success"
PROMPT_TOKENS = "vllm:prompt_tokens"
OUTPUT_TOKENS = "vllm:generation_tokens"
READ_TIMEOUT_S = 30.0


class TallyError(RuntimeError):
    """``/metrics`` could not be read or lacks vLLM's counters."""


@dataclass(frozen=True)
class EngineTally:
    finished: float  # requests, every finish reason (aborts included)
    prompt_tokens: float
    output_tokens: float

    def __sub__(self, earlier: EngineTally) -> EngineTally:
        return EngineTally(
            self.finished - earlier.finished,
            self.prompt_tokens - earlier.prompt_tokens,
            self.output_tokens - earlier.output_tokens,
        )


def parse_tally(text: str) -> EngineTally:
    """The counters, summed over their labels, from a ``/metrics`` page."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (FINISHED, PROMPT_TOKENS, OUTPUT_TOKENS):
            totals[family.name] = sum(
                s.value for s in family.samples if s.name.endswith("_total")
            )
    missing = {FINISHED, PROMPT_TOKENS, OUTPUT_TOKENS} - totals.keys()
    if missing:
        raise TallyError(f"vLLM's /metrics lacks {', '.join(sorted(missing))}")
    return EngineTally(totals[FINISHED], totals[PROMPT_TOKENS], totals[OUTPUT_TOKENS])


def read_tally(url: str) -> EngineTally:
    try:
        response = httpx.get(url + "/metrics", timeout=READ_TIMEOUT_S)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise TallyError(f"could not read {url}/metrics: {exc}") from exc
    return parse_tally(response.text)


def unseen_answers(tally: EngineTally, answered: Iterable[int]) -> int:
    """How many of the clients' answers (``answered``: completed requests per
    user) this engine did not finish: 0 when it gave them all."""
    return max(0, sum(answered) - round(tally.finished))
