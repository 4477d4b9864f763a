"""Per-user cache salt at the engine funnel, in process: every prompt shape
gets its user's salt, a client's own salt is overwritten, and the salt is one
vLLM accepts (tests/e2e/test_gateway.py measures the cache it isolates).
"""

from __future__ import annotations

import asyncio

import pytest
from vllm.engine.protocol import StreamingInput
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest

from vllm_output_rate.identity import Caller, Identity
from vllm_output_rate.integration import api_validation, engine_setup, trusted_identity
from vllm_output_rate.integration.cache_salt import salt_for, salted
from vllm_output_rate.integration.trusted_identity import (
    IdentityPolicy,
    RequestIdentity,
    current_identity,
    stamp_or_refuse,
)

ALICE = salt_for(Identity("alice"))


def test_one_salt_per_user_that_vllm_accepts() -> None:
    assert salt_for(Identity("alice")) == ALICE  # the same in every process
    assert salt_for(Identity("bob")) != ALICE
    for user in ("alice", "x" * 256, "a/b@c\\d", "Zoë"):
        salt = salt_for(Identity(user))
        validate_cache_salt(salt)  # at most 128 characters, no @ / \\ NUL
        assert user not in salt


def core_request(salt: str | None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=[1],
        mm_features=None,
        sampling_params=SamplingParams(),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=salt,
        data_parallel_rank=None,
    )


def test_every_prompt_shape_gets_the_salt() -> None:
    # Rendered input (what every online route sends): a copy, salt replaced.
    rendered = tokens_input([1, 2, 3], cache_salt="client-salt")
    assert salted(rendered, ALICE) == {
        "type": "token",
        "prompt_token_ids": [1, 2, 3],
        "cache_salt": ALICE,
    }
    assert rendered["cache_salt"] == "client-salt"  # the original is left alone
    # Raw prompts.
    assert salted("hi", ALICE) == {"prompt": "hi", "cache_salt": ALICE}
    assert salted([5, 6], ALICE) == {"prompt_token_ids": [5, 6], "cache_salt": ALICE}
    assert salted({"prompt": "hi", "cache_salt": "x"}, ALICE)["cache_salt"] == ALICE
    # An EngineCoreRequest is changed in place.
    request = core_request("client-salt")
    assert salted(request, ALICE) is request and request.cache_salt == ALICE


def test_a_prompt_it_cannot_salt_is_refused() -> None:
    for prompt in (
        {"type": "enc_dec", "encoder_prompt": {}, "decoder_prompt": {}},
        {"encoder_prompt": "hi", "decoder_prompt": None},
        object(),
    ):
        with pytest.raises(VLLMValidationError, match="cache-salt"):
            salted(prompt, ALICE)


@pytest.fixture
def alice_salted(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(trusted_identity, "policy", IdentityPolicy(cache_salt=True))
    token = current_identity.set(RequestIdentity(Caller(header_user="alice")))
    yield
    current_identity.reset(token)


def test_the_funnel_overwrites_the_clients_salt(alice_salted) -> None:
    prompt, params = stamp_or_refuse(
        tokens_input([1, 2], cache_salt="someone-elses"), SamplingParams()
    )
    assert prompt["cache_salt"] == ALICE
    assert params.extra_args == {"output_rate_user": "alice"}
    request = core_request("someone-elses")
    stamp_or_refuse(request, SamplingParams())
    assert request.cache_salt == ALICE

    async def inputs():
        yield StreamingInput(prompt=tokens_input([1], cache_salt="x"))
        yield StreamingInput(prompt=tokens_input([2]))

    async def collect(stream):
        return [chunk async for chunk in stream]

    streamed, _ = stamp_or_refuse(inputs(), SamplingParams())
    chunks = asyncio.run(collect(streamed))
    assert [chunk.prompt["cache_salt"] for chunk in chunks] == [ALICE, ALICE]


def test_the_early_check_stamps_the_user_and_leaves_the_prompt_to_the_funnel(
    alice_salted, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_setup, "limiting_enabled", True)
    params = SamplingParams()
    api_validation.check_sampling_params(params)
    assert params.extra_args == {"output_rate_user": "alice"}


def test_without_the_option_the_clients_salt_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trusted_identity, "policy", IdentityPolicy(header="x-user"))
    token = current_identity.set(RequestIdentity(Caller(header_user="alice")))
    try:
        prompt, _ = stamp_or_refuse(tokens_input([1], cache_salt="own"), None)
        assert prompt["cache_salt"] == "own"
    finally:
        current_identity.reset(token)


def test_the_salt_follows_the_decided_user_without_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Salt only, no identity option: the user comes from vllm_xargs (the
    # same trust as without the option), outside any middleware too.
    monkeypatch.setattr(trusted_identity, "policy", IdentityPolicy(cache_salt=True))
    params = SamplingParams(extra_args={"output_rate_user": "bob"})
    prompt, _ = stamp_or_refuse(tokens_input([1]), params)
    assert prompt["cache_salt"] == salt_for(Identity("bob"))
    prompt, _ = stamp_or_refuse(tokens_input([1]), SamplingParams())
    assert prompt["cache_salt"] == salt_for(Identity("__anonymous__"))
