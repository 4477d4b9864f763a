"""LoadSpec validation and the request bodies (pure)."""

from __future__ import annotations

import math

import pytest

from vllm_output_rate.loadtest.spec import (
    USER_FIELD,
    LoadSpec,
    UserLoad,
    build_request_body,
    normalize_base_url,
)


def spec_for(**kw) -> LoadSpec:
    defaults = dict(base_url="http://x", model="m", users=[UserLoad("a", 1)])
    return LoadSpec(**{**defaults, **kw})


class TestRequestBody:
    def test_completions_named_user(self):
        spec = spec_for(max_tokens=7, prompt="hi")
        body = build_request_body(spec, UserLoad("alice", 1))
        assert body == {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
            "vllm_xargs": {USER_FIELD: "alice"},
        }

    def test_chat_anonymous_has_no_xargs(self):
        spec = spec_for(endpoint="chat", prompt="hi", ignore_eos=False)
        body = build_request_body(spec, UserLoad(None, 1))
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        assert "prompt" not in body and "vllm_xargs" not in body
        assert body["ignore_eos"] is False

    def test_extra_body_merges_xargs(self):
        spec = spec_for(
            extra_body={"temperature": 0.0, "vllm_xargs": {"k": 1}},
            return_token_ids=False,
        )
        body = build_request_body(spec, UserLoad("bob", 1))
        assert body["temperature"] == 0.0
        assert body["vllm_xargs"] == {"k": 1, USER_FIELD: "bob"}
        assert "return_token_ids" not in body
        assert spec.extra_body == {"temperature": 0.0, "vllm_xargs": {"k": 1}}

    def test_normalize_base_url(self):
        assert normalize_base_url("http://h:1/") == "http://h:1"
        assert normalize_base_url("http://h:1/v1/") == "http://h:1"
        assert normalize_base_url(" http://h:1/v1 ") == "http://h:1"


class TestSpecValidation:
    @pytest.mark.parametrize(
        "kw",
        [
            dict(users=[]),
            dict(users=[UserLoad("a", 1), UserLoad("a", 2)]),
            dict(users=[UserLoad(None, 1), UserLoad(None, 1)]),
            dict(users=[UserLoad("a", 0)]),
            dict(users=[UserLoad("a", 1.5)]),
            dict(users=[UserLoad("", 1)]),
            dict(users=[UserLoad("a", 1, limit=0)]),
            dict(users=[UserLoad("a", 1, limit=math.inf)]),
            dict(users=[UserLoad("a", 1, think_s=-0.1)]),
            dict(users=[UserLoad("a", 1, think_s=math.nan)]),
            dict(max_tokens=0),
            dict(duration_s=0),
            dict(request_timeout_s=-1),
            dict(endpoint="embeddings"),
        ],
    )
    def test_rejects(self, kw):
        with pytest.raises(ValueError):
            spec_for(**kw)

    def test_accepts_the_anonymous_user_and_limits(self):
        spec = spec_for(users=[UserLoad(None, 2, limit=5.0), UserLoad("a", 1)])
        assert [u.label for u in spec.users] == ["(anonymous)", "a"]
