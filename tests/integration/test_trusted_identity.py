"""API keys, the identity middleware and the stamp at the engine funnel, in
process (no vLLM server; tests/e2e/test_trusted_identity.py runs them on one).
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from vllm.engine.protocol import StreamingInput
from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest

from vllm_output_rate.api_keys import ApiKeys, digest
from vllm_output_rate.identity import Caller
from vllm_output_rate.integration import api_validation, engine_setup, trusted_identity
from vllm_output_rate.integration.cli_flags import check_api_keys_option
from vllm_output_rate.integration.trusted_identity import (
    IdentityMiddleware,
    IdentityPolicy,
    IdentityRequiredError,
    RequestIdentity,
    current_identity,
    stamp_or_refuse,
)
from vllm_output_rate.validation import OutputRateConfigError


def keys() -> ApiKeys:
    return ApiKeys({"alice": [digest("a-key")], "bob": [digest("b-key")]}, "test")


def test_keys_map_to_users_by_digest_only() -> None:
    table = keys()
    assert table.user_for("a-key") == "alice"
    assert table.user_for("b-key") == "bob"
    assert table.user_for("") is None
    assert table.user_for("a-key ") is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"alice": ["plain-key"]}, "sha256"),
        ({"alice": []}, "list of key digests"),
        ({"": [digest("x")]}, "must not be empty"),
        ({"alice": [digest("x")], "bob": [digest("x")]}, "two users"),
    ],
)
def test_bad_key_files_are_refused(content: dict, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message):
        ApiKeys(content, "keys.yaml")


@pytest.fixture(autouse=True)
def keys_policy(monkeypatch: pytest.MonkeyPatch) -> IdentityPolicy:
    """The policy the HTTP plugin sets from a keys file (no gateway)."""
    policy = IdentityPolicy(keys=keys())
    monkeypatch.setattr(trusted_identity, "policy", policy)
    return policy


class Holder:
    identity_policy: IdentityPolicy | None = IdentityPolicy(keys=keys())


def alice_identity() -> RequestIdentity:
    return RequestIdentity(Caller("alice", may_assert=False))


def funnel_user() -> str:
    """What the engine funnel does: stamp the verified user or refuse."""
    _, params = stamp_or_refuse(
        None, SamplingParams(extra_args={"output_rate_user": "bob"})
    )
    return str(params.extra_args["output_rate_user"])


def app_with_middleware(holder: Holder) -> TestClient:
    """Routes that reach the 'engine' the ways vLLM's do: in the handler, in
    a streaming body after the status line, in a task, on a WebSocket."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"user": funnel_user()}

    @app.post("/invocations")
    async def invocations() -> StreamingResponse:
        async def body():
            try:
                yield f"data: {funnel_user()}\n\n"
            except IdentityRequiredError as exc:  # as vLLM's stream handlers do
                yield f"data: error {exc}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/in-a-task")
    async def in_a_task() -> dict:
        # vLLM runs some handlers in a task (with_cancellation): tasks copy
        # the request's context, identity included.
        async def reach_engine() -> str:
            return funnel_user()

        return {"user": await asyncio.create_task(reach_engine())}

    @app.get("/v1/models")
    @app.get("/health")
    async def models() -> dict:
        identity = current_identity.get()
        return {"identity": None if identity is None else identity.caller.key_user}

    @app.websocket("/v1/realtime")
    async def realtime(socket: WebSocket) -> None:
        await socket.accept()
        try:
            await socket.send_text(funnel_user())
        except IdentityRequiredError:
            await socket.send_text("refused")
        await socket.close()

    # vLLM's own exception handlers, as on a real server.
    app.state.args = argparse.Namespace(log_error_stack=False)
    init_exception_handler(app)
    app.add_middleware(IdentityMiddleware, holder=holder)
    return TestClient(app)


ALICE = {"Authorization": "Bearer a-key"}


def test_the_key_decides_the_user_on_every_kind_of_route() -> None:
    client = app_with_middleware(Holder())
    assert client.post("/v1/completions", headers=ALICE).json() == {"user": "alice"}
    assert client.post("/invocations", headers=ALICE).text == "data: alice\n\n"
    assert client.post("/in-a-task", headers=ALICE).json() == {"user": "alice"}
    assert client.get("/v1/models", headers=ALICE).json() == {"identity": "alice"}
    with client.websocket_connect("/v1/realtime", headers=ALICE) as socket:
        assert socket.receive_text() == "alice"
    assert current_identity.get() is None  # nothing leaks out of a request


def test_without_a_key_nothing_reaches_the_engine_and_the_answer_is_401() -> None:
    client = app_with_middleware(Holder())
    for path in ("/v1/completions", "/invocations", "/in-a-task"):
        refused = client.post(path)
        # Also the stream, whose status line was ready before the refusal.
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "alice" not in refused.text and "bob" not in refused.text
    # What vLLM's own --api-key guards needs a key here too, generating or
    # not (the keys file replaces --api-key): refused before the handler.
    assert client.get("/v1/models").status_code == 401
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        client.websocket_connect("/v1/realtime") as socket,
    ):
        socket.receive_text()
    assert closed.value.code == 1008
    # OPTIONS (CORS preflight) passes, as with --api-key.
    assert client.options("/v1/models").status_code != 401
    # Outside those prefixes only the funnel refuses, and only generation.
    assert client.get("/health").json() == {"identity": None}


def test_a_wrong_key_gets_401_on_any_route() -> None:
    client = app_with_middleware(Holder())
    for headers in ({"Authorization": "Bearer nope"}, {"Authorization": "Bearer "}):
        assert client.post("/v1/completions", headers=headers).status_code == 401
    assert (
        client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code
        == 401
    )
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        client.websocket_connect(
            "/v1/realtime", headers={"Authorization": "Bearer nope"}
        ) as socket,
    ):
        socket.receive_text()
    assert closed.value.code == 1008
    # Not a bearer token: treated as no key (refused where it would generate).
    assert (
        client.post("/v1/completions", headers={"Authorization": "a-key"}).status_code
        == 401
    )


def test_without_keys_the_middleware_changes_nothing() -> None:
    holder = Holder()
    holder.identity_policy = None
    client = app_with_middleware(holder)
    for headers in ({}, ALICE, {"Authorization": "Bearer nope"}):
        answer = client.get("/v1/models", headers=headers)
        assert answer.json() == {"identity": None}  # no identity recorded


def test_the_stamp_reaches_every_set_of_sampling_parameters() -> None:
    token = current_identity.set(alice_identity())
    try:
        core_request = EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[1],
            mm_features=None,
            sampling_params=SamplingParams(extra_args={"output_rate_user": "bob"}),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        prompt, params = stamp_or_refuse(core_request, SamplingParams())
        assert prompt.sampling_params.extra_args == {"output_rate_user": "alice"}
        assert params.extra_args == {"output_rate_user": "alice"}
        # Other extra_args survive.
        _, params = stamp_or_refuse(None, SamplingParams(extra_args={"k": 1}))
        assert params.extra_args == {"k": 1, "output_rate_user": "alice"}
        # Pooling parameters carry no user.
        pooling = PoolingParams()
        assert stamp_or_refuse(None, pooling)[1] is pooling

        async def inputs():
            yield StreamingInput(prompt={"prompt_token_ids": [1]})
            yield StreamingInput(
                prompt={"prompt_token_ids": [2]},
                sampling_params=SamplingParams(extra_args={"output_rate_user": "bob"}),
            )

        async def collect(stream):
            return [chunk async for chunk in stream]

        streamed, _ = stamp_or_refuse(inputs(), SamplingParams())
        chunks = asyncio.run(collect(streamed))
        assert chunks[0].sampling_params is None  # takes the stamped params
        assert chunks[1].sampling_params.extra_args == {"output_rate_user": "alice"}
    finally:
        current_identity.reset(token)


def test_outside_any_request_the_stamp_refuses() -> None:
    with pytest.raises(IdentityRequiredError) as refused:
        stamp_or_refuse(None, SamplingParams())
    assert refused.value.http_status == 401


def test_the_early_check_follows_the_same_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_setup, "limiting_enabled", True)
    with pytest.raises(IdentityRequiredError):
        api_validation.check_sampling_params(SamplingParams())
    token = current_identity.set(alice_identity())
    try:
        # A malformed body user does not matter: the key's user replaces it.
        params = SamplingParams(extra_args={"output_rate_user": 5})
        api_validation.check_sampling_params(params)
        assert params.extra_args == {"output_rate_user": "alice"}
    finally:
        current_identity.reset(token)


def test_a_foreign_engine_client_is_refused_when_identity_is_required() -> None:
    with pytest.raises(OutputRateConfigError, match="AsyncLLM"):
        api_validation.guard_engine_client(object(), IdentityPolicy(keys=keys()))
    with pytest.raises(OutputRateConfigError, match="AsyncLLM"):
        api_validation.guard_engine_client(object(), IdentityPolicy(cache_salt=True))
    client = object()
    api_validation.guard_engine_client(client, None)  # unguarded


def test_a_keys_file_that_would_be_ignored_is_refused(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"alice:\n  - {digest('a-key')}\n")
    args = argparse.Namespace(output_rate_api_keys=str(keys_file), api_key=None)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(OutputRateConfigError, match="VLLM_PLUGINS"):
        check_api_keys_option(args, limiting=True)
    monkeypatch.setenv("VLLM_PLUGINS", "output_rate,output_rate_http")
    with pytest.raises(OutputRateConfigError, match="needs --default"):
        check_api_keys_option(args, limiting=False)
    check_api_keys_option(args, limiting=True)
    args.api_key = ["secret"]
    with pytest.raises(OutputRateConfigError, match="--api-key"):
        check_api_keys_option(args, limiting=True)
