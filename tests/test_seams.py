"""Every vLLM internal in ``seams.py`` is there, and nothing of ours collides.

The checks ``verify_seams`` and ``check_host`` make at start-up run here
against the installed vLLM, and must fail loudly when an internal moves.
The scheduler subclasses add exactly one attribute to vLLM's scheduler
(``output_rate``) and override only the methods ``seams.py`` lists; a vLLM
release that adds a name of ours to its ``Scheduler`` fails here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from harness.scheduler_sim import make_scheduler
from vllm_output_rate import seams as seams_module
from vllm_output_rate import seams_check
from vllm_output_rate.integration.scheduler import (
    OutputRateAsyncScheduler,
    OutputRateMixin,
    OutputRateScheduler,
)
from vllm_output_rate.scheduling.demand import LAST_SERVED_ATTR, USER_ATTR
from vllm_output_rate.seams_facts import SOURCE_FACTS
from vllm_output_rate.vllm_source import LiveSource, StaticSource

# The vLLM methods the subclasses override on purpose (listed in seams.py).
OVERRIDDEN = {
    "__init__",
    "schedule",
    "add_request",
    "shutdown",
    "update_from_output",
    "get_grammar_bitmask",
    "finish_requests",
    "update_draft_token_ids",
    "reset_prefix_cache",
    "_reserve_prefill_lookahead",
    "_handle_blocked_waiting_request",
}
LIMITS = {"default_user_output_tokens_per_second": 10}


def test_seams_exist_with_the_expected_signatures() -> None:
    seams_check.verify_seams(api=True, imports=True)


def test_a_moved_seam_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_reserve_prefill_lookahead")
    with pytest.raises(seams_module.SeamMovedError, match="_reserve_prefill"):
        seams_check.verify_seams(api=False)


def test_a_lost_prefill_chunk_flag_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fast path counts sampled tokens from this flag after the step.
    from vllm.v1.core.sched.scheduler import Scheduler

    def update_after_schedule(self, scheduler_output) -> None:
        self.finished_req_ids = set()

    monkeypatch.setattr(Scheduler, "_update_after_schedule", update_after_schedule)
    with pytest.raises(seams_module.SeamMovedError, match="is_prefill_chunk"):
        seams_check.verify_seams(api=False)


def test_the_overrides_are_exactly_the_listed_seams() -> None:
    ours = {
        name
        for name in vars(OutputRateMixin)
        if not (name.startswith("__") and name != "__init__")
    }
    assert ours - {"output_rate"} == OVERRIDDEN
    for name in OVERRIDDEN - {"__init__"}:
        assert name in seams_module.SchedulerHost.__dict__, name
        assert callable(getattr(Scheduler, name))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_our_state_cannot_collide_with_vllms_attributes(
    tiny_model_path: str, is_async: bool
) -> None:
    stock = make_scheduler(tiny_model_path, limits=None, is_async=is_async)
    ours = make_scheduler(tiny_model_path, limits=LIMITS, is_async=is_async)
    expected = OutputRateAsyncScheduler if is_async else OutputRateScheduler
    assert type(ours.scheduler) is expected
    stock_names = set(vars(stock.scheduler)) | set(dir(type(stock.scheduler)))
    added = set(vars(ours.scheduler)) - set(vars(stock.scheduler))
    assert added == {"output_rate"}
    assert "output_rate" not in stock_names
    for base in (Scheduler, AsyncScheduler):
        assert not hasattr(base, "output_rate")


def test_a_real_scheduler_has_every_declared_host_attribute(
    tiny_model_path: str,
) -> None:
    scheduler = make_scheduler(tiny_model_path, limits=None).scheduler
    seams_check.check_host(scheduler)
    for name in seams_module.HOST_ATTRIBUTES:
        assert hasattr(scheduler, name), name


def test_a_scheduler_without_a_declared_attribute_is_refused() -> None:
    class Stripped:
        running = ()

    with pytest.raises(seams_module.SeamMovedError, match="_inflight_prefills"):
        seams_check.check_host(Stripped())


def test_our_request_tags_cannot_collide_with_vllms(tiny_model_path: str) -> None:
    from vllm.v1.request import Request

    stock = make_scheduler(tiny_model_path, limits=None)
    request = stock.add("a")
    for name in (USER_ATTR, LAST_SERVED_ATTR):
        assert not hasattr(Request, name)
        assert not hasattr(request, name)


def test_a_path_into_the_engine_around_the_funnel_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Trusted identity stamps or refuses at AsyncLLM.add_request: a method
    # that sends requests to the engine core any other way would bypass it.
    from vllm.v1.engine.async_llm import AsyncLLM

    async def submit_directly(self, request) -> None:
        await self.engine_core.add_request_async(request)

    monkeypatch.setattr(AsyncLLM, "submit_directly", submit_directly, raising=False)
    with pytest.raises(seams_module.SeamMovedError, match="submit_directly"):
        seams_check.verify_seams(api=True)


def test_a_changed_funnel_signature_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    async def add_request(self, prompt, request_id, params) -> None: ...

    monkeypatch.setattr(AsyncLLM, "add_request", add_request)
    with pytest.raises(seams_module.SeamMovedError, match="add_request"):
        seams_check.verify_seams(api=True)


def test_no_api_route_talks_to_the_engine_core_directly() -> None:
    # Routes reach the engine through the engine client's generate/encode,
    # which go through the funnel; none uses the engine core client itself.
    import vllm.entrypoints

    root = Path(vllm.entrypoints.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "add_request_async" in path.read_text(errors="replace")
        or ".engine_core." in path.read_text(errors="replace")
    ]
    assert offenders == []


def test_a_changed_preemption_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The lock-out rules preempt with vLLM's own _preempt_request and rely
    # on it freeing the KV blocks and queueing the request again.
    def preempt_request(self, request, timestamp, drop_stale_output=False) -> None:
        request.status = "PREEMPTED"

    monkeypatch.setattr(Scheduler, "_preempt_request", preempt_request)
    with pytest.raises(seams_module.SeamMovedError, match="_preempt_request"):
        seams_check.verify_seams(api=False)


def test_the_preemption_seam_is_vllms_recompute_preemption(
    tiny_model_path: str,
) -> None:
    from vllm.v1.request import RequestStatus

    h = make_scheduler(tiny_model_path, limits=None, num_blocks=100)
    scheduler = h.scheduler
    empty = seams_module.num_free_kv_blocks(scheduler)
    request = h.add("a", prompt_len=40, max_tokens=10)
    h.step()
    free = seams_module.num_free_kv_blocks(scheduler)
    assert free == empty - 3  # a 40-token prompt in 16-token blocks
    assert seams_module.kv_watermark_blocks(scheduler) == 0
    seams_module.preempt(scheduler, request)
    assert request not in scheduler.running
    assert scheduler.waiting.peek_request() is request
    assert request.status == RequestStatus.PREEMPTED
    assert request.num_computed_tokens == 0
    assert seams_module.num_free_kv_blocks(scheduler) == free + 3
    output = h.step()
    assert request.request_id in output.preempted_req_ids
    h.run_until_done(0)
    assert len(h.outputs[request.request_id]) == 10  # resumed, unchanged


# ----- the same checks against a vLLM source tree (never imported) ----------

INSTALLED = Path(vllm.__file__).parent.parent
ROOT = Path(__file__).parent.parent
OUR_CODE = (ROOT / "tests", ROOT / "benchmarks")
# `make vllm-next` unpacks the next vLLM release's wheel here (GPU only: it
# cannot run on these machines, but its source can be checked).
NEXT_SOURCE = Path(
    os.environ.get("VLLM_OUTPUT_RATE_NEXT_VLLM", ".cache/vllm-next")
).resolve()


def test_the_static_check_reads_the_installed_vllm_like_the_live_one() -> None:
    static, live = StaticSource(INSTALLED), LiveSource()
    assert seams_check.seam_problems(static, also_imports_of=OUR_CODE) == []
    assert seams_check.seam_problems(live, also_imports_of=OUR_CODE) == []
    for module, path, _ in seams_module.EXPECTED_SIGNATURES:
        static_params = static.function(module, path).params
        live_params = live.function(module, path).params
        assert live_params in (static_params, static_params[1:]), path
    for module, path, needle, _ in SOURCE_FACTS:
        assert needle in static.function(module, path).source


def test_a_moved_seam_fails_the_static_check(tmp_path: Path) -> None:
    # A copy of the files the checks read, with two seams moved.
    for module in (
        {m for m, *_ in seams_module.EXPECTED_SIGNATURES}
        | {m for m, *_ in SOURCE_FACTS}
        | {m for m, _ in seams_module.REQUEST_CLASSES}
    ):
        parts = module.split(".")
        for depth in range(1, len(parts)):
            target = tmp_path.joinpath(*parts[:depth], "__init__.py")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        shutil.copy(
            INSTALLED.joinpath(*parts).with_suffix(".py"),
            tmp_path.joinpath(*parts).with_suffix(".py"),
        )
    scheduler = tmp_path / "vllm/v1/core/sched/scheduler.py"
    text = scheduler.read_text()
    text = text.replace("def _reserve_prefill_lookahead(", "def _reserve_lookahead(")
    text = text.replace("request.append_output_token_ids(", "request.extend(")
    scheduler.write_text(text)
    problems = seams_check.seam_problems(StaticSource(tmp_path), imports=False)
    assert any("_reserve_prefill_lookahead no longer exists" in p for p in problems)
    assert any("appends a step's tokens" in p for p in problems)
    with pytest.raises(seams_module.SeamMovedError, match="_reserve_prefill"):
        seams_check.verify_seams(source=StaticSource(tmp_path))


@pytest.mark.skipif(
    not (NEXT_SOURCE / "vllm" / "__init__.py").is_file(),
    reason=f"no vLLM source at {NEXT_SOURCE} (run `make vllm-next`)",
)
def test_the_next_vllm_release_has_every_seam() -> None:
    """Every seam, and every vLLM name the package, its tests and its
    benchmarks import, in the next release's source."""
    source = StaticSource(NEXT_SOURCE)
    assert seams_check.seam_problems(source, also_imports_of=OUR_CODE) == []


def test_every_request_field_the_policy_reads_is_checked(
    monkeypatch: pytest.MonkeyPatch, tiny_model_path: str
) -> None:
    h = make_scheduler(tiny_model_path, limits=None)
    request = h.add("a", prompt_len=8, max_tokens=2)
    for name in seams_module.REQUEST_FIELDS:
        assert hasattr(request, name), name
    monkeypatch.setattr(
        seams_module, "REQUEST_FIELDS", (*seams_module.REQUEST_FIELDS, "num_cats")
    )
    problems = seams_check.seam_problems(LiveSource(), api=False, imports=False)
    assert problems == ["no longer true: Request keeps num_cats"]
