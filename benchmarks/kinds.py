"""Engine kinds as data: every pair of engines the benchmarks compare.

A ``Pair`` is one load on one model with two ``Side``s, the baseline and the
candidate, that differ only in what the plugin does: stock vLLM (the plugin
not even loaded) against ours, or ours against ours leasing its limits from
a shared store. ``engine_throughput`` runs any pair in paired rounds; the
sections choose pairs by name (``PAIRS``). The policies of the saturated
load (weights, floors, the engine's few active slots) and the speculation
settings live here too, because the server benchmarks use the same ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.demo.tiny_model_recipe import DEFAULT_VARIANT

FAR_LIMIT = 1e6  # tok/s: "far above demand", never binds
STORE_URL_ENV = "VLLM_OUTPUT_RATE_BENCH_STORE_URL"  # the store side's Redis

# Fair shares (section "Fair shares"): weights and a floor on ours, and an
# engine with few active slots, so that the engine is the bottleneck.
WEIGHTS = {"light": 2.0, "hog": 20.0}
FLOORS = {"floored": 60.0}
FAIRNESS = {
    "user_output_weight": WEIGHTS,
    "user_min_output_tokens_per_second": FLOORS,
}
SATURATED_LIMITS = {"max_num_seqs": 40, "max_num_active_seqs": 3}
SATURATED_USERS = ("even-a", "even-b") * 18

# n-gram speculation on the tiny "echo" model, which predicts its input
# token, so drafts are accepted.
DRAFT_TOKENS = 4
SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": DRAFT_TOKENS,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


@dataclass(frozen=True)
class Load:
    """One round: ``generates`` batches of one request per entry of
    ``users`` (None: anonymous), ``max_tokens`` each; or, when
    ``continuous``, as many tokens with every stream kept busy (a request
    that ends is replaced at once)."""

    users: tuple[str | None, ...]
    max_tokens: int
    generates: int
    continuous: bool = False
    # Prompt tokens per request (None: a short prompt); each request's own,
    # so that no prefix cache serves them.
    prompt_len: int | None = None

    def tokens_for(self, generates: int) -> int:
        return generates * len(self.users) * self.max_tokens


@dataclass(frozen=True)
class Side:
    """One engine of a pair."""

    label: str
    plugin: bool  # False: stock vLLM, VLLM_PLUGINS=""
    output_rate: Mapping[str, Any] = field(default_factory=dict)
    store: bool = False  # lease the limits from the store at STORE_URL_ENV


@dataclass(frozen=True)
class Pair:
    """Two engines on the same model, engine settings and load."""

    name: str
    description: str
    baseline: Side
    candidate: Side
    load: Load
    variant: str = DEFAULT_VARIANT  # of the tiny model (demo/tiny_model.py)
    llm_args: Mapping[str, Any] = field(default_factory=dict)
    greedy: bool = False


STOCK = Side("stock", plugin=False)
OURS = Side(
    "ours",
    plugin=True,
    output_rate={"default_user_output_tokens_per_second": FAR_LIMIT},
)
PLAIN_LOAD = Load((None,) * 32, max_tokens=256, generates=4)
# 16 users, 32 requests of 512-token prompts and 64 tokens out a batch: about
# 8 prompt tokens computed for each output token.
PROMPT_LOAD = Load(
    tuple(f"user-{i}" for i in range(16)) * 2,
    max_tokens=64,
    generates=2,
    prompt_len=512,
)

PAIRS: dict[str, Pair] = {
    pair.name: pair
    for pair in (
        Pair("plain", "limits far above demand", STOCK, OURS, PLAIN_LOAD),
        Pair(
            "prompt",
            "long prompts, prompt rates (and output limits) far above demand",
            STOCK,
            Side(
                "ours",
                True,
                {
                    **OURS.output_rate,
                    "default_user_prompt_tokens_per_second": FAR_LIMIT,
                },
            ),
            PROMPT_LOAD,
        ),
        Pair(
            "hybrid",
            "the tiny hybrid (Mamba2 + attention) model, limits far above demand",
            STOCK,
            OURS,
            PLAIN_LOAD,
            variant="hybrid",
        ),
        Pair(
            "saturated",
            "3 active slots, two users of 18 streams kept busy, weights and a "
            "floor on ours",
            STOCK,
            Side("ours", True, {**OURS.output_rate, **FAIRNESS}),
            Load(SATURATED_USERS, max_tokens=64, generates=2, continuous=True),
            llm_args=SATURATED_LIMITS,
        ),
        Pair(
            "speculative",
            "n-gram speculation on the echo model, greedy, limits far above demand",
            STOCK,
            OURS,
            PLAIN_LOAD,
            variant="echo",
            llm_args={"speculative_config": SPECULATION},
            greedy=True,
        ),
        Pair(
            "store",
            "ours leasing its limits from a shared store against ours alone",
            OURS,
            Side("ours with the store", True, OURS.output_rate, store=True),
            PLAIN_LOAD,
        ),
    )
}
