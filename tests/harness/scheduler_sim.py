"""Drive vLLM's real V1 scheduler and KV cache manager without a model.

Used by the scheduler-level tests and the scheduler benchmarks.

The engine configuration is built the way ``vllm serve`` builds it (through
``EngineArgs.create_engine_config`` on the tiny local model), the scheduler is
vLLM's own class (or ours), and only the model runner is replaced by
synthetic outputs: every request whose scheduled chunk reaches the end of its
sequence samples one token. Asynchronous scheduling is reproduced by
processing each step's output one step late, as vLLM's batch queue does;
``in_flight`` keeps more steps in flight (pipeline parallelism).

With ``num_spec_tokens`` the engine configuration has n-gram speculative
decoding: after each synchronous step the harness proposes draft tokens for
every request that sampled (``proposals``), as vLLM's drafter does, and the
model accepts some of the drafts a step verifies (``acceptance``; by default
a uniform draw seeded by the request and its output position), emitting the
accepted drafts plus one token. Drafts vLLM pads with ``-1`` (a request
just taken from the waiting queue) are always rejected, as vLLM's rejection
sampler does.

``hybrid=True`` adds a Mamba state group to the KV cache (vLLM's hybrid
allocator, states cached at block boundaries: ``mamba_cache_mode="align"``);
``encoder_budget`` gives the scheduler an encoder compute budget and cache,
so that requests added with ``mm_placeholders`` carry synthetic multimodal
inputs (the encoder itself is not run: only its scheduling is real).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from harness.fake_clock import FakeClock
from vllm_output_rate.config import ADDITIONAL_CONFIG_KEY
from vllm_output_rate.limiter import OutputRateLimiter

BLOCK_SIZE = 16
# Hybrid models: vLLM makes attention and Mamba pages the same size, so
# blocks are larger.
HYBRID_BLOCK_SIZE = 64
SAMPLED_TOKEN = 42  # any id that is not EOS


@dataclass
class Dispatch:
    """What one step did for one request (from the scheduler's output)."""

    step: int
    time_ns: int
    request_id: str
    user: str
    num_tokens: int
    samples: bool
    drafts: int = 0


# (request, drafts verified in the step) -> drafts accepted
Acceptance = Callable[[Request, int], int]


@dataclass
class _InFlight:
    output: SchedulerOutput
    sampling: set[str]
    time_ns: int
    padded: set[str]  # requests whose drafts are vLLM's -1 padding


@dataclass
class SchedulerHarness:
    scheduler: Scheduler
    clock: FakeClock
    eos_token_id: int
    is_async: bool
    # Steps whose output is still to come when the next step is scheduled.
    in_flight: int = 0
    num_spec_tokens: int = 0
    # Speculative decoding: drafts proposed for a request after a step, and
    # how many of a step's drafts the model accepts.
    proposals: Callable[[Request], int] | None = None
    acceptance: Acceptance | None = None
    # The default acceptance's seed: a request's draws depend on it, the
    # request and its output position only, never on the order in which a
    # step lists its requests.
    seed: int = 15
    # Every (request, step) the scheduler dispatched, in order.
    dispatches: list[Dispatch] = field(default_factory=list)
    # request id -> output token ids received so far (from update_from_output)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # id -> finish reason
    users: dict[str, str] = field(default_factory=dict)  # request id -> user
    # request id -> 0-based output index at which the model emits EOS
    eos_at: dict[str, int] = field(default_factory=dict)
    # (dispatch time, user) of every token a request received
    received_at: list[tuple[int, str]] = field(default_factory=list)
    # A request id for every encoder input scheduled (multimodal)
    encoder_scheduled: list[str] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    # request id -> steps in which it was preempted (by vLLM or the plugin)
    preempted_at: dict[str, list[int]] = field(default_factory=dict)
    # request id -> step before which it was added
    added_at: dict[str, int] = field(default_factory=dict)
    block_size: int = BLOCK_SIZE
    # How long the latest schedule() and get_grammar_bitmask() took: the
    # scheduler's work for a step before the model's output.
    schedule_ns: int = 0
    # The part of schedule_ns spent in get_grammar_bitmask(), which vLLM's
    # engine calls once the step has gone to the model worker (ours settles
    # the step there): schedule_ns - settle_ns is what the engine waits for.
    settle_ns: int = 0
    update_ns: int = 0  # how long the latest update_from_output() took
    asks_grammar_bitmask: bool = True  # see step()
    _pending: deque[_InFlight] = field(default_factory=deque)
    _ids: Any = field(default_factory=itertools.count)

    # ----- requests ----------------------------------------------------

    def add(
        self,
        user: str | None,
        *,
        prompt_len: int = 8,
        max_tokens: int = 16,
        prompt: list[int] | None = None,
        priority: int = 0,
        eos_at: int | None = None,
        extra_args: dict[str, Any] | None = None,
        mm_placeholders: Sequence[tuple[int, int]] = (),
        lora: int | None = None,
        seed: int | None = None,
    ) -> Request:
        request_id = f"req-{next(self._ids)}"
        if prompt is None:
            # Distinct prompts so that prefix caching does not merge them.
            base = len(self.users) + 3
            prompt = [(base * 31 + i * 7) % 400 + 10 for i in range(prompt_len)]
        if extra_args is None and user is not None:
            extra_args = {"output_rate_user": user}
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=eos_at is None,
            extra_args=extra_args,
            seed=seed,
        )
        params.update_from_generation_config({}, self.eos_token_id)
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=f"{request_id}-image-{i}",
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for i, (offset, length) in enumerate(mm_placeholders)
        ]
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            priority=priority,
            arrival_time=self.clock.now_ns / 1e9,
            block_hasher=_block_hasher(self.block_size),
            mm_features=features or None,
            lora_request=_lora(lora),
        )
        self.outputs[request_id] = []
        self.added_at[request_id] = self.steps + 1
        if eos_at is not None:
            self.eos_at[request_id] = eos_at
        self.scheduler.add_request(request)
        # The user as the scheduler understood it (ours parses extra_args).
        self.users[request_id] = getattr(request, "output_rate_user", user or "")
        return request

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.finished[request_id] = "abort"

    # ----- steps -------------------------------------------------------

    def step(
        self, advance_ns: int = 0, between: Callable[[], object] | None = None
    ) -> SchedulerOutput:
        """Advance the clock, schedule once, and feed back model output.

        ``between``: what the engine does after scheduling the step, before
        it asks for the grammar bitmask (an abort, a new request, an
        operator's call); ``asks_grammar_bitmask``: whether it asks (vLLM's
        engine always does, except for a step waiting on structured output).
        """
        self.clock.advance(advance_ns)
        started = time.perf_counter_ns()
        output = self.scheduler.schedule()
        self.schedule_ns = time.perf_counter_ns() - started
        self.settle_ns = 0
        self.steps += 1
        self.preemptions += len(output.preempted_req_ids)
        for request_id in output.preempted_req_ids:
            self.preempted_at.setdefault(request_id, []).append(self.steps)
        sampling = set()
        spec = output.scheduled_spec_decode_tokens
        for request_id, inputs in output.scheduled_encoder_inputs.items():
            self.encoder_scheduled += [request_id] * len(inputs)
        padded = {r.req_id for r in output.scheduled_new_reqs}
        padded |= output.scheduled_cached_reqs.resumed_req_ids
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            # After scheduling, a chunk that reached the end is not a prefill
            # chunk any more: the model samples a token for it.
            samples = not request.is_prefill_chunk
            if samples:
                sampling.add(request_id)
            self.dispatches.append(
                Dispatch(
                    self.steps,
                    self.clock.now_ns,
                    request_id,
                    self.users[request_id],
                    num_tokens,
                    samples,
                    len(spec.get(request_id, ())),
                )
            )
        self._pending.append(_InFlight(output, sampling, self.clock.now_ns, padded))
        # The step has gone to the model (recorded above).
        if between is not None:
            between()
        # As vLLM's EngineCore.step: the grammar bitmask is asked for once the
        # step has gone to the worker (ours settles the step there).
        if self.asks_grammar_bitmask:
            started = time.perf_counter_ns()
            self.scheduler.get_grammar_bitmask(output)
            self.settle_ns = time.perf_counter_ns() - started
            self.schedule_ns += self.settle_ns
        # Synchronous: results come back before the next schedule(). Async:
        # one step stays in flight, like vLLM's batch queue of depth 2.
        while len(self._pending) > self.in_flight:
            self._finish_oldest()
        return output

    def drain(self) -> None:
        """Process the step still in flight (async)."""
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        step = self._pending.popleft()
        output = step.output
        spec = output.scheduled_spec_decode_tokens
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in req_ids:
            if request_id not in step.sampling or request_id in self.finished:
                sampled.append([])
                continue
            drafts = len(spec.get(request_id, ()))
            accepted = 0
            if drafts and request_id not in step.padded:
                accepted = min(drafts, self._accepted(request_id, drafts))
            # Steps are processed in order: earlier outputs are already in.
            index = len(self.outputs[request_id])
            eos_index = self.eos_at.get(request_id)
            tokens = [
                self.eos_token_id if eos_index == index + i else SAMPLED_TOKEN
                for i in range(accepted + 1)
            ]
            sampled.append(tokens)
        model_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        started = time.perf_counter_ns()
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        self.update_ns = time.perf_counter_ns() - started
        for client_outputs in engine_outputs.values():
            for out in client_outputs.outputs:
                self.outputs[out.request_id].extend(out.new_token_ids)
                user = self.users[out.request_id]
                self.received_at.extend([(step.time_ns, user)] * len(out.new_token_ids))
                if out.finish_reason is not None:
                    self.finished[out.request_id] = str(out.finish_reason)
        if self.num_spec_tokens and not self.is_async:
            self._propose_drafts(req_ids)

    def _accepted(self, request_id: str, drafts: int) -> int:
        if self.acceptance is not None:
            return self.acceptance(self.scheduler.requests[request_id], drafts)
        position = len(self.outputs[request_id])
        return random.Random(f"{self.seed}/{request_id}/{position}").randint(0, drafts)

    def _propose_drafts(self, req_ids: list[str]) -> None:
        """What vLLM's engine does after a synchronous step: hand the
        drafter's proposals to the scheduler."""
        requests = self.scheduler.requests
        live = [rid for rid in req_ids if rid in requests]
        counts = [
            self.proposals(requests[rid]) if self.proposals else self.num_spec_tokens
            for rid in live
        ]
        self.scheduler.update_draft_token_ids(
            DraftTokenIds(live, [[SAMPLED_TOKEN] * n for n in counts])
        )

    def run_until_done(self, step_ns: int, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                self.drain()
                if not self.scheduler.has_requests():
                    return
            self.step(step_ns)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    # ----- observations -------------------------------------------------

    def sampled_at(self, user: str) -> list[int]:
        """Clock readings of every dispatched sampling step of ``user``."""
        return [d.time_ns for d in self.dispatches if d.user == user and d.samples]

    def prompt_token_times(self, user: str) -> list[int]:
        """When each of ``user``'s prompt tokens was computed (its step's
        clock): a dispatch's tokens but the sampled one and its drafts."""
        times = []
        for d in self.dispatches:
            if d.user == user:
                prompt = d.num_tokens - (1 + d.drafts if d.samples else 0)
                times += [d.time_ns] * prompt
        return times

    def first_token_step(self, request_id: str) -> int | None:
        """The step that sampled the request's first token (None: not yet)."""
        for d in self.dispatches:
            if d.request_id == request_id and d.samples:
                return d.step
        return None

    def received_by(self, user: str) -> list[int]:
        """Dispatch times of every token ``user`` received."""
        return [t for t, u in self.received_at if u == user]

    def received_tokens(self) -> dict[str, int]:
        """Tokens received per user."""
        totals: dict[str, int] = {}
        for request_id, tokens in self.outputs.items():
            user = self.users[request_id]
            totals[user] = totals.get(user, 0) + len(tokens)
        return {u: n for u, n in totals.items() if n}

    def settle(self) -> None:
        """End of a test: process every step in flight, abort what is left,
        and schedule once more so that the scheduler's refund point sees it
        all."""
        self.drain()
        for request_id in list(self.scheduler.requests):
            self.abort(request_id)
        self.scheduler.schedule()
        self.drain()

    def sampled_by_request(self, request_id: str) -> list[int]:
        return [
            d.time_ns
            for d in self.dispatches
            if d.request_id == request_id and d.samples
        ]


_hashers: dict[int, Callable[[Request], Any]] = {}


def _block_hasher(block_size: int) -> Callable[[Request], Any]:
    if block_size not in _hashers:
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        _hashers[block_size] = get_request_block_hasher(block_size, hash_fn)
    return _hashers[block_size]


def _lora(lora_id: int | None) -> Any:
    if lora_id is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}")


def make_scheduler(
    model_path: str,
    *,
    limits: dict[str, Any] | None,
    scheduler_cls: type[Scheduler] | None = None,
    is_async: bool = False,
    num_blocks: int = 10_000,
    max_num_seqs: int = 64,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 2048,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    clock: FakeClock | None = None,
    num_spec_tokens: int = 0,
    in_flight: int | None = None,
    hybrid: bool = False,
    encoder_budget: int = 0,
    disable_chunked_mm_input: bool = False,
    max_loras: int | None = None,
    kv_connector: str | None = None,
) -> SchedulerHarness:
    """A real vLLM scheduler on the tiny model's real engine configuration.

    ``limits`` is the ``additional_config['output_rate']`` section, or None
    for stock vLLM. The scheduler class defaults to vLLM's own, or to ours
    when limits are given. ``num_spec_tokens`` turns on n-gram speculative
    decoding with that many draft tokens; ``in_flight`` is how many steps
    stay in flight (default: 1 for async scheduling, else 0). ``max_loras``
    turns LoRA on (requests name an adapter with ``add(lora=...)``);
    ``kv_connector`` names a KV connector whose scheduler side runs for real
    (e.g. ``DecodeBenchConnector``: a P/D decode instance that receives every
    prompt token's KV but the last one's).
    """
    block_size = HYBRID_BLOCK_SIZE if hybrid else BLOCK_SIZE
    additional_config = {ADDITIONAL_CONFIG_KEY: limits} if limits is not None else {}
    engine_args = EngineArgs(
        model=model_path,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        block_size=block_size,
        disable_chunked_mm_input=disable_chunked_mm_input,
        enable_lora=max_loras is not None,
        max_loras=max_loras or 1,
        kv_transfer_config=(
            {"kv_connector": kv_connector, "kv_role": "kv_both"}
            if kv_connector
            else None
        ),
        additional_config=additional_config,
        skip_tokenizer_init=True,
        speculative_config=(
            {
                "method": "ngram",
                "num_speculative_tokens": num_spec_tokens,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
            if num_spec_tokens
            else None
        ),
    )
    vllm_config = engine_args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    groups = [
        KVCacheGroupSpec(
            ["layer"],
            FullAttentionSpec(
                block_size, num_kv_heads=1, head_size=64, dtype=_float32()
            ),
        )
    ]
    if hybrid:
        vllm_config.cache_config.mamba_cache_mode = "align"
        groups.append(
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size,
                    shapes=((8,),),
                    dtypes=(_float32(),),
                    mamba_cache_mode="align",
                ),
            )
        )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    if scheduler_cls is None:
        scheduler_cls = _default_class(limits is not None, is_async)
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
    if encoder_budget:
        # The tiny model has no encoder: give the scheduler the budget and
        # cache a multimodal model's configuration would.
        scheduler.max_num_encoder_input_tokens = encoder_budget
        scheduler.encoder_cache_manager = EncoderCacheManager(encoder_budget)
    clock = clock or FakeClock(1_000_000_000)
    if limits is not None and "store_url" not in limits:
        # (With a store the scheduler leases on the real clock by itself.)
        scheduler.output_rate.use_limiter(
            OutputRateLimiter(
                limits["default_user_output_tokens_per_second"],
                limits.get("user_output_tokens_per_second"),
                clock=clock,
            )
        )
    return SchedulerHarness(
        scheduler=scheduler,
        clock=clock,
        eos_token_id=1,
        is_async=is_async,
        in_flight=(1 if is_async else 0) if in_flight is None else in_flight,
        num_spec_tokens=num_spec_tokens,
        block_size=block_size,
    )


def _default_class(limited: bool, is_async: bool) -> type[Scheduler]:
    if not limited:
        return AsyncScheduler if is_async else Scheduler
    from vllm_output_rate.integration.scheduler import (
        OutputRateAsyncScheduler,
        OutputRateScheduler,
    )

    return OutputRateAsyncScheduler if is_async else OutputRateScheduler


def _float32() -> Any:
    import torch

    return torch.float32
