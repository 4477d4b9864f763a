"""Trusted identity on a live server: the API key, not the body, names the user."""

from __future__ import annotations

import time

import httpx
import pytest

from vllm_output_rate.api_keys import digest
from vllm_output_rate.demo.server import running_server

pytestmark = pytest.mark.e2e

KEYS = {"alice": "key-of-alice", "bob": "key-of-bob"}


@pytest.fixture(scope="module")
def server(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys_file.write_text(
        "".join(f"{user}:\n  - {digest(key)}\n" for user, key in KEYS.items())
    )
    args = [
        "--default-user-output-tokens-per-second",
        "1000",
        "--user-output-tokens-per-second",
        '{"alice": 2, "bob": 1000}',
        "--output-rate-api-keys",
        str(keys_file),
    ]
    env = {"VLLM_PLUGINS": "output_rate,output_rate_http"}
    with running_server(tiny_model_path, args, env=env) as url:
        assert KEYS["alice"] not in keys_file.read_text()  # only digests stored
        yield url


def generate(url: str, model: str, key: str | None, user: str | None, n: int):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "hi", "max_tokens": n, "ignore_eos": True}
    if user:
        body["vllm_xargs"] = {"output_rate_user": user}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_requests_need_a_valid_key(server, tiny_model_path) -> None:
    for key in (None, "guess", KEYS["alice"] + "x"):
        response = generate(server, tiny_model_path, key, "bob", 2)
        assert response.status_code == 401
        assert "alice" not in response.text and "bob" not in response.text
    assert httpx.get(server + "/v1/models").status_code == 200  # reads stay open
    assert generate(server, tiny_model_path, KEYS["bob"], None, 2).status_code == 200


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
