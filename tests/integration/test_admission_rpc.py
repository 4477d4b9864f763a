"""The engine's answer to the API servers' admission question, with the
real limiter and a stand-in scheduler: who is held back by its own limit,
what each user's requests still owe, and which API server sent them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_output_rate.integration.admission_rpc import admission_view, limits_page
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling.demand import USER_ATTR
from vllm_output_rate.scheduling.stats import MetricLabels


def request(user: str, max_tokens: int, done: int, client: int = 0) -> Any:
    return SimpleNamespace(
        **{USER_ATTR: user},
        max_tokens=max_tokens,
        num_output_tokens=done,
        client_index=client,
    )


def engine(requests: list[Any], limiter: OutputRateLimiter) -> tuple[Any, Any]:
    config = SimpleNamespace(
        additional_config={"output_rate": {"user_max_concurrent_requests": {"a": 3}}},
        scheduler_config=SimpleNamespace(
            max_num_queued_reqs=16, max_num_queued_tokens=None
        ),
    )
    core = SimpleNamespace(
        vllm_config=config,
        scheduler=SimpleNamespace(requests={str(i): r for i, r in enumerate(requests)}),
    )
    policy = SimpleNamespace(
        limiter=limiter,
        leases=None,
        stats=SimpleNamespace(labels=MetricLabels(["a"], recent_users=0)),
    )
    return core, policy


def test_only_users_their_limit_holds_back_are_paused() -> None:
    limiter = OutputRateLimiter(100, {"slow": 2, "fast": 100_000})
    limiter.take_many({"slow": 10, "fast": 10})  # slow's budget is spent
    core, policy = engine(
        [request("slow", 50, 10), request("slow", 20, 15), request("fast", 10, 0)],
        limiter,
    )
    answer = admission_view(core, policy, {"users": ["slow", "fast", "idle"]})
    limit, rate, wait_s, here, owed, fewest, label, elsewhere = answer["users"]["slow"]
    assert (limit, rate, here, owed, fewest, elsewhere) == (2, 2, 2, 45, 5, 0)
    assert wait_s > 0 and label == "__other__"
    # A user far below its limit is not held back, however the clock moved
    # between the reading and the answer.
    assert answer["users"]["fast"][2] == 0
    assert answer["users"]["idle"][2:6] == [0, 0, 0, 0]
    # The caps come with the first answer, and again only when they change.
    assert answer["caps"]["user_max_concurrent_requests"] == {"a": 3}
    again = admission_view(
        core, policy, {"users": [], "caps_version": answer["caps_version"]}
    )
    assert "caps" not in again and again["users"] == {}


def test_other_api_servers_requests_are_reported_to_each() -> None:
    limiter = OutputRateLimiter(100)
    core, policy = engine(
        [
            request("a", 5, 0, client=0),
            request("a", 5, 0, client=1),
            request("b", 5, 0, client=1),
        ],
        limiter,
    )
    answer = admission_view(core, policy, {"users": ["a"], "client": 0, "others": True})
    assert answer["users"]["a"][3] == 2 and answer["users"]["a"][7] == 1
    assert answer["users"]["b"][7] == 1  # only elsewhere, still reported
    assert answer["users"]["a"][6] == "a"  # a listed metrics label


def test_limits_pages_carry_the_caps_of_their_users() -> None:
    limiter = OutputRateLimiter(100)
    core, _ = engine([], limiter)
    seen = {}

    def page(limit: int, after: str | None, extra_users: Any = ()) -> Any:
        seen["extra"] = set(extra_users)
        return {"limits": {"default": 100}, "names": ["a"], "next": None, "total": 1}

    answer = limits_page(core, SimpleNamespace(limits_page=page), {"limit": 10})
    assert seen["extra"] == {"a"}  # users with caps of their own are paged
    assert answer["limits"]["user_max_concurrent_requests"] == {"a": 3}
    assert "names" not in answer


def test_a_change_only_the_engine_can_check_is_refused_not_raised() -> None:
    from vllm_output_rate.integration.engine_rpc import REFUSED, output_rate_rpc
    from vllm_output_rate.validation import OutputRateConfigError

    limiter = OutputRateLimiter(100)
    core, _ = engine([], limiter)
    applied: list[Any] = []

    def update_limits(body: dict[str, Any]) -> None:
        if "user_min_output_tokens_per_second" in body:
            raise OutputRateConfigError("floor of user 'a' is above its limit")
        applied.append(body)

    def page(limit: int, after: str | None, extra_users: Any = ()) -> Any:
        return {"limits": {}, "names": [], "next": None, "total": 0}

    core.scheduler.output_rate = SimpleNamespace(
        finish_step=lambda: None, update_limits=update_limits, limits_page=page
    )
    refused = output_rate_rpc(
        core,
        "update",
        {
            "body": {"user_min_output_tokens_per_second": {"a": 500}},
            "page": {"limit": 5},
        },
    )
    # The API server answers HTTP 400 with this; vLLM would make a raise a 500.
    assert refused == {REFUSED: "floor of user 'a' is above its limit"}
    assert not applied
    fine = output_rate_rpc(
        core,
        "update",
        {"body": {"user_output_tokens_per_second": {"a": 5}}, "page": {"limit": 5}},
    )
    assert REFUSED not in fine and applied
