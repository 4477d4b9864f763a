"""What vLLM's code must still do for the plugin to be right: ``SOURCE_FACTS``.

Part of the seams (``seams.py``), kept apart because it is long and only
data: each entry is (module, function, text its source must contain, the
fact). ``seams_check.py`` checks them against the installed vLLM at start-up
and against a source tree (``python -m vllm_output_rate.seams DIR``). Nothing
here imports vLLM.
"""

from __future__ import annotations

from vllm_output_rate.seams import SCHEDULER_MODULE

# Facts about vLLM's source the plugin relies on: (module, function, text
# its source must contain, the fact).
SOURCE_FACTS: list[tuple[str, str, str, str]] = [
    (SCHEDULER_MODULE, "Scheduler.schedule",
     ">= request.num_prompt_tokens + request.max_tokens",
     "Scheduler.schedule passes over a request whose last token is in flight "
     "(scheduling/token_shares.py counts nothing for it)"),
    (SCHEDULER_MODULE, "Scheduler.schedule", "self.max_num_active_reqs",
     "Scheduler.schedule reads max_num_active_reqs"),
    (SCHEDULER_MODULE, "Scheduler.schedule", "self._reserve_prefill_lookahead(",
     "Scheduler.schedule calls self._reserve_prefill_lookahead"),
    (SCHEDULER_MODULE, "Scheduler.schedule", "self._update_after_schedule(",
     "Scheduler.schedule calls self._update_after_schedule"),
    (SCHEDULER_MODULE, "Scheduler._update_after_schedule", "request.is_prefill_chunk =",
     "Scheduler._update_after_schedule sets Request.is_prefill_chunk"),
    (SCHEDULER_MODULE, "Scheduler._update_after_schedule",
     "self._inflight_prefills.discard(",
     "Scheduler._update_after_schedule drops finished prefills from "
     "_inflight_prefills"),
    (SCHEDULER_MODULE, "Scheduler._free_request", "self.finished_req_ids.add(",
     "Scheduler._free_request records finished_req_ids"),
    # A ranked step that sets its deferred requests aside (set_aside.py)
    # checks the step's input budget and how prefill chunks are sized.
    (SCHEDULER_MODULE, "Scheduler.schedule",
     "self.scheduler_config.max_num_batched_tokens",
     "Scheduler.schedule's input budget is max_num_batched_tokens"),
    (SCHEDULER_MODULE, "Scheduler.schedule",
     "self.scheduler_config.long_prefill_token_threshold",
     "Scheduler.schedule sizes prefill chunks by long_prefill_token_threshold"),
    # Lock-out rules (scheduling/residency.py).
    (SCHEDULER_MODULE, "Scheduler.schedule",
     "if num_running >= self.max_num_active_reqs:",
     "Scheduler.schedule stops admitting at max_num_active_reqs"),
    (SCHEDULER_MODULE, "Scheduler.schedule",
     "full_sequence_must_fit=self.scheduler_reserve_full_isl",
     "Scheduler.schedule admits only what scheduler_reserve_full_isl fits"),
    (SCHEDULER_MODULE, "Scheduler._preempt_request",
     "self._free_request_blocks(request)",
     "Scheduler._preempt_request frees the request's KV blocks"),
    (SCHEDULER_MODULE, "Scheduler._preempt_request",
     "self.waiting.prepend_request(request)",
     "Scheduler._preempt_request puts the request back into waiting"),
    (SCHEDULER_MODULE, "Scheduler.schedule", "while req_index < len(self.running)",
     "Scheduler.schedule serves the running requests from self.running"),
    (SCHEDULER_MODULE, "Scheduler.schedule", "preempted_req = self.running.pop()",
     "Scheduler.schedule preempts the last request of self.running"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.__init__",
     "self.num_kv_cache_groups =",
     "KVCacheManager counts its KV cache groups"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots",
     "self.watermark_blocks",
     "KVCacheManager.allocate_slots keeps watermark_blocks free"),
    # Speculative decoding (scheduling/speculative.py).
    (SCHEDULER_MODULE, "Scheduler.schedule", "] * self.num_spec_tokens",
     "Scheduler.schedule pads a waiting request's drafts with -1, which the "
     "rejection sampler always rejects"),
    (SCHEDULER_MODULE, "Scheduler._update_request_with_output",
     "request.append_output_token_ids(",
     "update_from_output appends a step's tokens to the request's output"),
    ("vllm.v1.request", "Request.num_output_tokens", "len(self._output_token_ids)",
     "Request.num_output_tokens counts the tokens of its output"),
    # Seeded requests on CPU (scheduling/engine_modes.py).
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync",
     "gen.set_offset(",
     "vLLM rewinds a seeded request's generator after a chunk that does not sample "
     "(which a CPU generator cannot)"),
    # The idle wait (integration/engine_loop.py).
    ("vllm.v1.engine.core", "EngineCore.__init__", "self.batch_queue",
     "EngineCore keeps its batches in flight in batch_queue"),
    # Admission (integration/admission.py, admission_rpc.py).
    *[("vllm.v1.engine.async_llm", "AsyncLLM.check_admission", needle,
       f"AsyncLLM.check_admission counts with {needle}")
      for needle in ("self.scheduler_config.max_num_queued_reqs",
                     "self.admission_stats.get_num_requests()",
                     "self.get_num_unfinished_requests()",
                     "self.scheduler_config.max_num_queued_tokens",
                     "self.get_num_queued_tokens()")],
    ("vllm.v1.engine.async_llm", "AsyncLLM._add_request",
     "self.check_admission(request_id=request.request_id)",
     "AsyncLLM._add_request checks admission before it registers a request"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.add_request",
     "self.check_admission(parent_params.n",
     "AsyncLLM.add_request checks admission for n > 1"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.add_request",
     "RequestOutputCollector(params.output_kind, request.request_id)",
     "AsyncLLM.add_request returns a collector named by the request id"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.__init__", "self.admission_stats =",
     "AsyncLLM keeps admission_stats"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.get_num_queued_tokens",
     "req.prompt_len for req in self.request_states.values() if req.is_prefilling",
     "OutputProcessor counts queued tokens from request_states"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.__init__",
     "self.parent_requests:", "OutputProcessor keeps parent_requests"),
    ("vllm.v1.engine.parallel_sampling", "ParentRequest.__init__",
     "self.child_requests =", "ParentRequest keeps its child_requests"),
    ("vllm.entrypoints.generate.base.serving", "GenerateBaseServing._preflight",
     "self.engine_client.check_admission(n)",
     "GenerateBaseServing._preflight checks admission"),
    *[(module, function, "await self._check_model(request)",
       f"{function} checks the model before its admission check")
      for module, function in (
          ("vllm.entrypoints.openai.chat_completion.serving",
           "OpenAIServingChat.render_chat_request"),
          ("vllm.entrypoints.openai.completion.serving",
           "OpenAIServingCompletion.render_completion_request"),
          ("vllm.entrypoints.openai.responses.serving",
           "OpenAIServingResponses._create_responses"),
          ("vllm.entrypoints.scale_out.token_in_token_out.serving",
           "ServingTokens.serve_tokens"))],
    ("vllm.v1.engine.core", "EngineCore.__init__", "self.vllm_config = vllm_config",
     "EngineCore keeps its vllm_config"),
    # Per-user cache salt (integration/cache_salt.py): the salt set on a
    # prompt at the funnel reaches the block hashes.
    ("vllm.v1.engine.input_processor", "InputProcessor.process_inputs",
     'cache_salt=decoder_input.get("cache_salt")',
     "InputProcessor.process_inputs takes a request's cache_salt from its prompt"),
    ("vllm.renderers.base", "BaseRenderer._process_tokens",
     'if cache_salt := prompt.get("cache_salt")',
     "BaseRenderer keeps a raw prompt's cache_salt"),
    ("vllm.v1.request", "Request.from_engine_core_request",
     "cache_salt=request.cache_salt",
     "Request takes its cache_salt from the EngineCoreRequest"),
    ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys",
     '("cache_salt", request.cache_salt)',
     "the hash of a request's first KV block mixes in its cache_salt"),
    ("vllm.v1.engine.async_llm", "AsyncLLM._add_streaming_input_request",
     "prompt=input_chunk.prompt",
     "AsyncLLM processes each streamed input from its prompt"),
    # Where a step is settled while the model runs (integration/scheduler.py).
    ("vllm.v1.engine.core", "EngineCore.step",
     "self.scheduler.get_grammar_bitmask(scheduler_output)",
     "EngineCore.step asks the scheduler for the step's grammar bitmask while the "
     "worker runs the step"),
]  # fmt: skip
