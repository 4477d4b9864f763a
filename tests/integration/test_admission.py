"""The API server's admission check against a stand-in engine client:
vLLM's global caps do not count paused users' requests, places reserved at
the door count until they register, a hammering client costs no engine
call, and several API servers see each other's requests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.exceptions import QueueOverflowError, VLLMValidationError

from vllm_output_rate.admission_caps import REQUESTS_KEY, TOKENS_KEY
from vllm_output_rate.integration import admission as adm
from vllm_output_rate.integration import admission_context as ctx
from vllm_output_rate.integration.admission_view import EngineViews


class FakeEngineClient:
    """What admission reads of vLLM's AsyncLLM, with requests as plain ids."""

    def __init__(self, max_reqs: int | None = None, max_tokens: int | None = None):
        self.scheduler_config = SimpleNamespace(
            max_num_queued_reqs=max_reqs, max_num_queued_tokens=max_tokens
        )
        self.admission_stats: Any = None
        self.output_processor = SimpleNamespace(request_states={}, parent_requests={})
        self.rejections: list[str] = []

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    def get_num_queued_tokens(self) -> int:
        states = self.output_processor.request_states.values()
        return sum(s.prompt_len for s in states if s.is_prefilling)

    def _record_admission_rejection(self, reason: str) -> None:
        self.rejections.append(reason)

    def register(self, request_id: str, prompt_len: int = 10) -> None:
        self.output_processor.request_states[request_id] = SimpleNamespace(
            prompt_len=prompt_len, is_prefilling=True
        )

    def finish(self, request_id: str) -> None:
        del self.output_processor.request_states[request_id]


class FakeEngines:
    """The engines' answers to the ``admission`` op."""

    def __init__(self, caps: dict[str, Any] | None = None) -> None:
        self.rows: dict[str, list[Any]] = {}
        self.caps = caps or {}
        self.calls: list[dict[str, Any]] = []

    def user(self, name: str, limit: float, wait_s: float = 0.0, **kw: Any) -> None:
        self.rows[name] = [
            limit,
            limit,
            wait_s,
            kw.get("requests", 0),
            kw.get("outstanding", 0),
            kw.get("fewest", 0),
            name,
            kw.get("elsewhere", 0),
        ]

    async def __call__(self, payload: dict[str, Any]) -> list[Any]:
        self.calls.append(payload)
        return [
            {
                "users": dict(self.rows),
                "caps_version": 1,
                "caps": {k: v for k, v in self.caps.items()},
                "global_caps": [None, None],
            }
        ]


def make(
    max_reqs: int | None = 16, caps: dict[str, Any] | None = None, **kw: Any
) -> tuple[adm.Admission, FakeEngineClient, FakeEngines]:
    client = FakeEngineClient(max_reqs, kw.get("max_tokens"))
    engines = FakeEngines(caps)
    views = EngineViews(engines, others=kw.get("others", False))
    checker = adm.Admission(client, views)
    views.local_users = checker.ledger.live_users
    return checker, client, engines


def request_of(user: str, n: int = 1) -> Any:
    return SimpleNamespace(vllm_xargs={"output_rate_user": user}, n=n, max_tokens=10)


def at_door(checker: adm.Admission, user: str, n: int = 1) -> ctx.AdmissionContext:
    """A request's check before rendering, as vLLM's _preflight makes it."""
    context = ctx.AdmissionContext()
    token = ctx.current.set(context)
    try:
        ctx.note_checked_request(request_of(user, n))
        checker.check_admission(n)
    finally:
        ctx.current.reset(token)
    return context


def enter(
    checker: adm.Admission,
    client: FakeEngineClient,
    user: str,
    request_id: str,
    context: ctx.AdmissionContext | None = None,
) -> None:
    """The request registers through the funnel (vLLM's add_request, which
    checks admission again before it registers)."""

    async def original(rid: str, prompt: Any, params: Any) -> Any:
        client.check_admission(request_id=rid)
        client.register(rid)
        return SimpleNamespace(request_id=rid)

    client.check_admission = checker.check_admission  # type: ignore[attr-defined]
    params = SimpleNamespace(extra_args={"output_rate_user": user}, n=1)

    async def run() -> None:
        token = ctx.current.set(context)
        try:
            await checker.enter(original, request_id, None, params)
        finally:
            ctx.current.reset(token)

    asyncio.run(run())


def test_paused_users_requests_do_not_fill_vllms_cap() -> None:
    checker, client, engines = make(max_reqs=4)
    for i in range(4):
        enter(checker, client, "hog", f"hog-{i}")
    engines.user("hog", 5, wait_s=0.2, requests=4)
    asyncio.run(checker.views.refresh())
    at_door(checker, "light")  # admitted: the hog's four do not count
    # Once the hog is no longer held back, its requests count again (after
    # the hold): the server is truly full and light gets vLLM's 503.
    engines.user("hog", 5, wait_s=0.0, requests=4)
    checker.views._paused_until.clear()
    asyncio.run(checker.views.refresh())
    with pytest.raises(QueueOverflowError):
        at_door(checker, "light-2")
    assert client.rejections == ["max_num_queued_reqs"]
    assert checker.rejections == {("__other__", "max_num_queued_reqs"): 1}


def test_a_user_seen_paused_stays_paused_for_a_moment() -> None:
    checker, client, engines = make(max_reqs=2)
    enter(checker, client, "hog", "h1")
    enter(checker, client, "hog", "h2")
    engines.user("hog", 5, wait_s=0.1, requests=2)
    asyncio.run(checker.views.refresh())
    engines.user("hog", 5, wait_s=0.0, requests=2)  # read on a token's due time
    asyncio.run(checker.views.refresh())
    at_door(checker, "light")


def test_places_reserved_at_the_door_count_until_they_register() -> None:
    checker, client, _ = make(max_reqs=2)
    first = at_door(checker, "a")
    second = at_door(checker, "b")
    assert checker.ledger.reserved_total == 2
    with pytest.raises(QueueOverflowError):
        at_door(checker, "c")
    # Registering turns the reservation into the request vLLM counts; vLLM's
    # own second check passes for it.
    enter(checker, client, "a", "a-1", first)
    assert checker.ledger.reserved_total == 1
    assert checker.ledger.requests("a") == 1
    # A request that never registers (rendering failed, client gone) gives
    # its place back when its HTTP request ends.
    checker.end(second)
    assert checker.ledger.reserved_total == 0
    at_door(checker, "c")


def test_the_users_own_cap_gives_429_with_its_reason() -> None:
    checker, client, _ = make(max_reqs=16, caps={REQUESTS_KEY: {"u": 2}})
    asyncio.run(checker.views.refresh())
    enter(checker, client, "u", "u-1")
    enter(checker, client, "u", "u-2")
    context = ctx.AdmissionContext()
    token = ctx.current.set(context)
    try:
        ctx.note_checked_request(request_of("u"))
        with pytest.raises(adm.UserOverCapError) as refused:
            checker.check_admission(1)
    finally:
        ctx.current.reset(token)
    assert refused.value.http_status == 429
    assert context.refused == ("user_max_concurrent_requests", 2)
    # A finished request gives its place back.
    client.finish("u-1")
    at_door(checker, "u")
    assert client.rejections == []  # vLLM's counter is for its own caps


def test_finished_requests_leave_nothing_behind() -> None:
    checker, client, engines = make()
    enter(checker, client, "once", "o-1")
    asyncio.run(checker.views.refresh())
    assert engines.calls[-1]["users"] == ["once"]
    client.finish("o-1")
    asyncio.run(checker.views.refresh())
    assert checker.ledger.entries == {}
    checker.views._watched.clear()  # as WATCH_S later
    asyncio.run(checker.views.refresh())
    assert checker.views.views == {}


def test_n_above_the_cap_is_bad_input() -> None:
    checker, _, _ = make(caps={REQUESTS_KEY: {"u": 2}})
    asyncio.run(checker.views.refresh())
    with pytest.raises(VLLMValidationError, match="n=3"):
        at_door(checker, "u", n=3)


def test_the_queued_token_cap_counts_prompts_waiting_for_their_first_token() -> None:
    checker, client, _ = make(caps={TOKENS_KEY: {"u": 15}})
    asyncio.run(checker.views.refresh())
    enter(checker, client, "u", "u-1")  # 10 prompt tokens, prefilling
    at_door(checker, "u")  # 10 < 15
    enter(checker, client, "u", "u-2")
    with pytest.raises(adm.UserOverCapError, match="prompt tokens"):
        at_door(checker, "u")
    client.output_processor.request_states["u-1"].is_prefilling = False
    at_door(checker, "u")


def test_a_bad_user_name_is_refused_before_rendering() -> None:
    checker, _, _ = make()
    with pytest.raises(VLLMValidationError, match="output_rate_user"):
        at_door(checker, "")


def test_a_hammering_client_costs_no_engine_call() -> None:
    checker, client, engines = make(caps={REQUESTS_KEY: {"u": 1}})
    asyncio.run(checker.views.refresh())
    enter(checker, client, "u", "u-1")
    calls = len(engines.calls)
    for _ in range(1000):
        with pytest.raises(adm.UserOverCapError):
            at_door(checker, "u")
    assert len(engines.calls) == calls
    assert checker.by_user["u"][0] == {"user_max_concurrent_requests": 1000}


def test_requests_sent_by_other_api_servers_count_against_the_cap() -> None:
    checker, client, engines = make(caps={REQUESTS_KEY: {"u": 3}}, others=True)
    engines.user("u", 10, requests=2, elsewhere=2)
    asyncio.run(checker.views.refresh())
    assert engines.calls[-1]["others"] is True
    enter(checker, client, "u", "u-1")  # 1 here + 2 elsewhere = 3
    with pytest.raises(adm.UserOverCapError):
        at_door(checker, "u")


def test_headers_come_from_the_engines_view() -> None:
    checker, _, engines = make(max_reqs=16)
    engines.user("u", 100, wait_s=0.0, requests=1, outstanding=90, fewest=90)
    asyncio.run(checker.views.refresh())
    context = at_door(checker, "u")
    headers = asyncio.run(checker.headers(context))
    # Not yet registered: this request's 10 tokens count beside the 90.
    assert headers["x-ratelimit-remaining-tokens"] == str(6000 - 100)
    assert headers["x-ratelimit-limit-requests"] == "16"
    assert headers["x-ratelimit-remaining-requests"] == "15"
    assert "retry-after" not in headers
