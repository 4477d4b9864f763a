"""API keys and the identity middleware, in process (no vLLM server)."""

from __future__ import annotations

import argparse

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from vllm.sampling_params import SamplingParams

from vllm_output_rate.api_keys import ApiKeys, digest
from vllm_output_rate.integration.cli_flags import check_api_keys_option
from vllm_output_rate.integration.trusted_identity import (
    TrustedIdentityMiddleware,
    apply_verified_user,
    verified_user,
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


class Holder:
    api_keys: ApiKeys | None = keys()


def app_with_middleware(holder: Holder) -> TestClient:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        params = SamplingParams(extra_args={"output_rate_user": "bob"})
        apply_verified_user(params)
        return {"user": params.extra_args["output_rate_user"]}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    app.add_middleware(TrustedIdentityMiddleware, keys_holder=holder)
    return TestClient(app)


def test_the_key_decides_the_user_and_bad_keys_get_401() -> None:
    client = app_with_middleware(Holder())
    ok = client.post("/v1/completions", headers={"Authorization": "Bearer a-key"})
    assert ok.json() == {"user": "alice"}  # spoofed "bob" overwritten
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "a-key"}):
        refused = client.post("/v1/completions", headers=headers)
        assert refused.status_code == 401
        assert "alice" not in refused.text and "bob" not in refused.text
    assert client.get("/v1/models").status_code == 200
    assert verified_user.get() is None  # nothing leaks out of the request


def test_without_keys_the_middleware_changes_nothing() -> None:
    holder = Holder()
    holder.api_keys = None
    client = app_with_middleware(holder)
    assert client.post("/v1/completions").json() == {"user": "bob"}


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
