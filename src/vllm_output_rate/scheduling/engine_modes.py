"""What vLLM's engine modes ask of the hold-back and admission (no vLLM import).

The policy holds a request back short of its sampling position, or leaves a
waiting request queued, when its user has no budget. ``EngineModes`` knows
the engine's modes and answers:

* ``hold_back_end``: where a prefill may stop without sampling (held back
  for lack of budget, or trimmed to its user's share of the step): on a Mamba
  block boundary for hybrid models (``mamba_block_size``), nowhere when the
  sampling position is inside a placeholder of multimodal input that must
  not be chunked (``split_mm_inputs=False``), or for a seeded request on CPU
  (``seeded_partial_prefill`` off: its generator cannot be rewound);
* ``may_cut``: whether a chunk may be cut to a user's share of the step
  (not through an image that must not be split);
* ``may_only_run_by_sampling``: whether admitting a waiting request could
  leave only its sampling position (a prefix-cache or KV-connector hit);
* ``adapter_fits``: whether ``--max-loras`` holds with every resident
  request's adapter counted.

Why each, and what broke without it: docs/architecture.md, "Engine modes".
Requests are vLLM ``Request`` objects (read: ``mm_features``,
``lora_request``, ``sampling_params``, ``num_tokens``, ``num_computed_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class EngineModes:
    chunked_prefill: bool = True
    prefix_caching: bool = False
    # The prefix cache's block size (a hit stops on one of its boundaries).
    hash_block_size: int = 16
    mamba_block_size: int | None = None
    split_mm_inputs: bool = True
    external_kv: bool = False
    max_loras: int | None = None
    seeded_partial_prefill: bool = True
    # The adapters of the resident requests, computed once per step.
    _resident_loras: tuple[int, set[int]] = field(
        default_factory=lambda: (-1, set()), repr=False
    )

    def hold_back_end(
        self, request: Request, end: int, limit: int | None = None
    ) -> int:
        """The furthest position a prefill can stop at without sampling.

        One short of ``end`` (the sampling position), or ``limit`` if that is
        before it, except: on a Mamba block boundary (vLLM's invariant: the
        state slot of block p holds the state after exactly (p + 1) x
        block_size tokens); and none (0) when multimodal input must not be
        chunked and the stop is inside a placeholder, or when a seeded
        request's generator could not be rewound after the chunk.
        """
        stop: int = end - 1 if limit is None else min(limit, end - 1)
        if not self.seeded_partial_prefill:
            params = request.sampling_params
            if params is not None and params.seed is not None:
                return 0
        if self.mamba_block_size:
            stop -= stop % self.mamba_block_size
        if not self.split_mm_inputs:
            for feature in request.mm_features:
                position = feature.mm_position
                if position.offset < stop < position.offset + position.length:
                    return 0
        return stop

    def may_cut(self, request: Request, start: int, end: int) -> bool:
        """Whether a chunk vLLM sized from ``start`` to ``end`` may be cut
        short: not when multimodal input must not be chunked and an image
        lies in it (vLLM planned the chunk's encoder runs before the hook)."""
        if self.split_mm_inputs:
            return True
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset < end and start < position.offset + position.length:
                return False
        return True

    def may_only_run_by_sampling(self, request: Request) -> bool:
        """Whether admitting this waiting request could leave nothing to
        compute but its sampling position (vLLM 0.32 ends its waiting scan
        at a request whose hook then returns 0)."""
        if not self.chunked_prefill:
            return True  # the whole prompt runs at once and samples
        computed = request.num_computed_tokens
        stop = self.hold_back_end(request, request.num_tokens)
        if stop <= computed:
            return True
        if computed == 0 and self.external_kv:
            return True  # the connector's hit may reach the last token
        # A prefix-cache hit stops at a block boundary and at most one token
        # before the end; when it can reach the furthest stop, only the
        # sampling position is left to compute.
        block = self.hash_block_size
        longest_hit = (request.num_tokens - 1) // block * block
        return bool(self.prefix_caching and computed == 0 and longest_hit >= stop)

    def adapter_fits(
        self, request: Request, step: int, running: Iterable[Request]
    ) -> bool:
        """Whether admitting ``request`` keeps the resident requests within
        ``--max-loras`` adapters.

        vLLM 0.32 checks ``--max-loras`` against the adapters of the
        requests scheduled in the step; a throttled resident is not, so a
        request of another adapter could be admitted beside it, and the
        next step scheduling both would exceed the limit (vLLM asserts and
        the engine dies). This counts every resident request, as vLLM 0.33
        does itself.
        """
        lora = request.lora_request
        if self.max_loras is None or lora is None or lora.lora_int_id <= 0:
            return True
        computed_at, resident = self._resident_loras
        if computed_at != step:
            resident = {
                r.lora_request.lora_int_id
                for r in running
                if r.lora_request is not None and r.lora_request.lora_int_id > 0
            }
            self._resident_loras = (step, resident)
        if lora.lora_int_id in resident or len(resident) < self.max_loras:
            resident.add(lora.lora_int_id)  # it may be admitted now
            return True
        return False
