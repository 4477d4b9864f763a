"""Trusted identity on a live server: the API key, not the body, names the
user, on every route of the app, and no route reaches the engine without one.

The routes are enumerated from the server's own app (vLLM's ``build_app``
with the server's arguments, checked against the live ``/openapi.json``):
a route that a later vLLM adds fails ``test_every_route_is_covered`` until
it is listed below, as generating (then tested) or not, with the reason.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from vllm_output_rate.api_keys import digest
from vllm_output_rate.demo.server import running_server

pytestmark = pytest.mark.e2e

KEYS = {"alice": "key-of-alice", "bob": "key-of-bob", "carol": "key-of-carol"}
GATEWAY_KEY, USER_HEADER = "key-of-the-proxy", "x-end-user"
ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPOOF = {"vllm_xargs": {"output_rate_user": "alice"}}
CHAT = [{"role": "user", "content": "hi"}]


def generating_routes(model: str) -> dict[tuple[str, str], list[dict]]:
    """Each route that samples tokens, with bodies that make it do so (each
    claiming to be alice where the route takes a user at all)."""
    completion = {"model": model, "prompt": "hi", "max_tokens": 2, **SPOOF}
    chat = {"model": model, "messages": CHAT, "max_tokens": 2, **SPOOF}
    responses = {"model": model, "input": "hi", "max_output_tokens": 2, **SPOOF}
    messages = {"model": model, "messages": CHAT, "max_tokens": 2, **SPOOF}
    return {
        ("POST", "/v1/completions"): [completion, {**completion, "stream": True}],
        ("POST", "/v1/chat/completions"): [chat, {**chat, "stream": True}],
        ("POST", "/v1/chat/completions/batch"): [{**chat, "messages": [CHAT]}],
        ("POST", "/v1/responses"): [responses, {**responses, "stream": True}],
        ("POST", "/v1/messages"): [messages, {**messages, "stream": True}],
        ("POST", "/invocations"): [completion, chat],
        ("POST", "/inference/v1/generate"): [
            {
                "model": model,
                "token_ids": [1, 2, 3],
                "sampling_params": {"max_tokens": 2, "extra_args": SPOOF["vllm_xargs"]},
            }
        ],
        ("POST", "/generative_scoring"): [
            {"model": model, "query": "hi", "items": ["a"], "label_token_ids": [1, 2]}
        ],
    }


# Routes that would generate with another model, and the answer this tiny
# model gets before anything reaches the engine (checked with and without a
# key: if one starts to generate here, move it to generating_routes).
def unservable_routes(model: str) -> dict[tuple[str, str], tuple[dict, int]]:
    return {
        ("POST", "/v1/systemone"): (  # structured decisions: no strategy here
            {"model": model, "state": "hi", "questions": {"q": {"type": "noul"}}},
            501,
        ),
    }


# Every other route, and why it never reaches the engine.
NOT_GENERATING = {
    ("GET", "/openapi.json"): "API description",
    ("HEAD", "/openapi.json"): "API description",
    ("GET", "/docs"): "API description",
    ("HEAD", "/docs"): "API description",
    ("GET", "/docs/oauth2-redirect"): "API description",
    ("HEAD", "/docs/oauth2-redirect"): "API description",
    ("GET", "/redoc"): "API description",
    ("HEAD", "/redoc"): "API description",
    ("GET", "/load"): "server load",
    ("GET", "/version"): "version",
    ("GET", "/kv_event_sources"): "KV event configuration",
    ("GET", "/health"): "health check",
    ("GET", "/ping"): "health check (SageMaker)",
    ("POST", "/ping"): "health check (SageMaker)",
    ("GET", "/metrics"): "Prometheus metrics",
    ("MOUNT", "/metrics"): "Prometheus metrics",
    ("GET", "/v1/models"): "model list",
    ("POST", "/tokenize"): "tokenizer only",
    ("POST", "/detokenize"): "tokenizer only",
    ("POST", "/v1/messages/count_tokens"): "tokenizer only",
    ("POST", "/v1/chat/completions/render"): "prompt rendering only",
    ("POST", "/v1/messages/render"): "prompt rendering only",
    ("POST", "/v1/completions/render"): "prompt rendering only",
    ("POST", "/v1/responses/render"): "prompt rendering only",
    ("POST", "/v1/chat/completions/derender"): "detokenizing only",
    ("POST", "/v1/completions/derender"): "detokenizing only",
    ("GET", "/v1/responses/{response_id}"): "reads a stored response",
    ("POST", "/v1/responses/{response_id}/cancel"): "cancels a response",
    ("POST", "/inference/v1/abort_requests"): "aborts requests",
    ("POST", "/scale_elastic_ep"): "elastic expert parallelism control",
    ("POST", "/is_scaling_elastic_ep"): "elastic expert parallelism control",
    ("GET", "/v1/output_rate/limits"): "plugin admin (own key)",
    ("PUT", "/v1/output_rate/limits"): "plugin admin (own key)",
    ("GET", "/v1/output_rate/stats"): "plugin admin (own key)",
}


def server_args(keys_file: str) -> list[str]:
    return [
        "--default-user-output-tokens-per-second",
        "1000",
        "--user-output-tokens-per-second",
        '{"alice": 2, "bob": 1000}',
        "--output-rate-api-keys",
        keys_file,
        "--output-rate-user-header",
        USER_HEADER,
        "--enable-scale-out",  # serves /inference/v1/generate
    ]


ENV = {
    "VLLM_PLUGINS": "output_rate,output_rate_http",
    "VLLM_OUTPUT_RATE_ADMIN_KEY": ADMIN_KEY,
}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(
        "".join(f"{user}:\n  - {digest(key)}\n" for user, key in KEYS.items())
        + f"proxy: {{keys: [{digest(GATEWAY_KEY)}], gateway: true}}\n"
    )
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_model_path: str, keys_file: str) -> Iterator[str]:
    with running_server(tiny_model_path, server_args(keys_file), env=ENV) as url:
        with open(keys_file) as stored:  # only digests are stored
            assert KEYS["alice"] not in stored.read()
        yield url


def app_routes(server, model: str, keys_file: str) -> set[tuple[str, str]]:
    """(method, path) of every route of the server's app, built in this
    process by vLLM's own build_app from the server's arguments."""
    from fastapi.routing import APIRoute
    from starlette.routing import Mount, Route, WebSocketRoute
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.app import build_app

    from harness.vllm_cli import vllm_parser

    found = re.search(r"Supported tasks: \[(.*?)\]", server.log_text())
    assert found, "the server logs its supported tasks"
    tasks = tuple(task.strip(" '\"") for task in found.group(1).split(","))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENV.items():
            patch.setenv(name, value)
        parser = vllm_parser()
        args = parser.parse_args(["--model", model, *server_args(keys_file)])
        model_config = EngineArgs.from_cli_args(args).create_model_config()
        app = build_app(args, tasks, model_config)
    routes: set[tuple[str, str]] = set()
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            routes |= {(method, route.path) for method in route.methods or ()}
        elif isinstance(route, WebSocketRoute):
            routes.add(("WEBSOCKET", route.path))
        elif isinstance(route, Mount):
            routes.add(("MOUNT", route.path))
        else:
            routes.add((type(route).__name__, getattr(route, "path", "?")))
    return routes


def test_every_route_is_covered(server, tiny_model_path: str, keys_file: str) -> None:
    routes = app_routes(server, tiny_model_path, keys_file)
    # The app built here is the server's: everything it documents is in it.
    documented = {
        (method.upper(), path)
        for path, operations in httpx.get(server + "/openapi.json")
        .json()["paths"]
        .items()
        for method in operations
    }
    assert documented <= routes, documented - routes
    covered = (
        generating_routes(tiny_model_path).keys()
        | unservable_routes(tiny_model_path).keys()
        | NOT_GENERATING.keys()
    )
    assert routes - covered == set(), (
        "routes without a trusted-identity test: list each in generating_routes "
        "(with a body that samples) or NOT_GENERATING (with the reason)"
    )
    assert covered - routes == set(), "listed routes that the app no longer has"


def engine_counts(url: str) -> tuple[float, float]:
    """Engine-side work so far: tokens our scheduler dispatched (all users)
    and prompt tokens vLLM processed."""
    users = httpx.get(url + "/v1/output_rate/stats", headers=ADMIN).json()["users"]
    dispatched = sum(user["tokens_admitted"] for user in users.values())
    prompt_tokens = sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith("vllm:prompt_tokens_total{")
    )
    return dispatched, prompt_tokens


def user_tokens(url: str, user: str) -> int:
    users = httpx.get(url + "/v1/output_rate/stats", headers=ADMIN).json()["users"]
    return int(users.get(user, {}).get("tokens_admitted", 0))


def post(
    url: str, path: str, body: dict, key: str | None, end_user: str | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if end_user:
        headers[USER_HEADER] = end_user
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def test_no_route_reaches_the_engine_without_a_valid_key(
    server, tiny_model_path: str
) -> None:
    before = engine_counts(server)
    for (_, path), bodies in generating_routes(tiny_model_path).items():
        for body in bodies:
            for key in (None, "guess", KEYS["carol"] + "x"):
                response = post(server, path, body, key)
                # A real 401 even for streams: no 200 with an error inside.
                assert response.status_code == 401, (path, body, response.text)
                assert response.json()["error"]["code"] == 401
                assert "alice" not in response.text and "carol" not in response.text
    for (_, path), (body, status) in unservable_routes(tiny_model_path).items():
        for key in (None, KEYS["carol"]):
            assert post(server, path, body, key).status_code in (status, 401), path
    time.sleep(1.5)  # anything that did reach the engine has been counted
    assert engine_counts(server) == before


def test_keys_guard_everything_vllms_api_key_would(server) -> None:
    # The keys file replaces --api-key, so every route under vLLM's guarded
    # prefixes needs a valid key, aborts and model lists included.
    from vllm_output_rate.seams import api_key_guarded_prefixes

    guarded = api_key_guarded_prefixes()
    checked = 0
    for method, path in NOT_GENERATING:
        if not path.startswith(guarded) or path.startswith("/v1/output_rate/"):
            continue
        if method not in ("GET", "POST", "PUT", "DELETE"):
            continue
        url = server + path.replace("{response_id}", "resp-x")
        for key in (None, "guess"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            answer = httpx.request(method, url, headers=headers, json={}, timeout=30)
            assert answer.status_code == 401, (method, path, key, answer.text)
        checked += 1
    assert checked >= 10  # /v1/models, abort_requests, render, tokenize, ...
    alice = {"Authorization": f"Bearer {KEYS['alice']}"}
    assert httpx.get(server + "/v1/models", headers=alice).status_code == 200
    assert httpx.get(server + "/health").status_code == 200  # as with --api-key


def test_every_generating_route_charges_the_keys_user(
    server, tiny_model_path: str
) -> None:
    # Carol's key, bodies claiming alice: carol is charged, never alice.
    for (_, path), bodies in generating_routes(tiny_model_path).items():
        for body in bodies:
            carol, alice = user_tokens(server, "carol"), user_tokens(server, "alice")
            response = post(server, path, body, KEYS["carol"])
            assert response.status_code == 200, (path, body, response.text)
            assert "error" not in response.text[:200], (path, response.text)
            assert user_tokens(server, "carol") > carol, (path, body)
            assert user_tokens(server, "alice") == alice, (path, body)


def test_every_generating_route_charges_the_end_user_a_gateway_names(
    server, tiny_model_path: str
) -> None:
    # The gateway's key naming dave, bodies claiming alice: dave is charged.
    # Carol's ordinary key naming dave by the header: carol is charged.
    for (_, path), bodies in generating_routes(tiny_model_path).items():
        for body in bodies:
            for key, charged in ((GATEWAY_KEY, "dave"), (KEYS["carol"], "carol")):
                others = {u: user_tokens(server, u) for u in ("alice", "dave", "proxy")}
                before = user_tokens(server, charged)
                response = post(server, path, body, key, end_user="dave")
                assert response.status_code == 200, (path, body, response.text)
                assert "error" not in response.text[:200], (path, response.text)
                assert user_tokens(server, charged) > before, (path, body, key)
                others.pop(charged, None)
                assert {u: user_tokens(server, u) for u in others} == others, path


def generate(url: str, model: str, key: str | None, user: str | None, n: int):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "hi", "max_tokens": n, "ignore_eos": True}
    if user:
        body["vllm_xargs"] = {"output_rate_user": user}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_the_load_tool_runs_each_user_under_its_own_key(
    server, tiny_model_path: str
) -> None:
    from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync

    before = {user: user_tokens(server, user) for user in ("bob", "carol")}
    spec = LoadSpec(
        base_url=server,
        model=tiny_model_path,
        users=[UserLoad("bob", 2), UserLoad("carol", 1)],
        max_tokens=8,
        duration_s=1.0,
        api_keys={"bob": KEYS["bob"], "carol": KEYS["carol"]},
    )
    result = run_load_sync(spec)
    assert not result.failed_requests
    time.sleep(1.5)  # the API server's copy of the engine's counters
    for user in ("bob", "carol"):
        received = result.user(user).tokens_server
        assert received > 0
        assert user_tokens(server, user) - before[user] == received, user
    assert KEYS["bob"] not in result.to_json()


def test_a_spoofed_user_name_does_not_use_that_users_budget(
    server, tiny_model_path
) -> None:
    # Alice (2 tok/s) claims to be bob (1000 tok/s): she still gets 2 tok/s.
    started = time.monotonic()
    response = generate(server, tiny_model_path, KEYS["alice"], "bob", 7)
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 7
    # 7 tokens at 2 tok/s with a 0.1 s burst: at least (7 - 1) / 2 - 0.1 s.
    assert elapsed >= 2.9
    # Bob, with his own key, is not slowed down by alice's spoofing.
    started = time.monotonic()
    assert (
        generate(server, tiny_model_path, KEYS["bob"], "alice", 50).status_code == 200
    )
    assert time.monotonic() - started < 2.9
