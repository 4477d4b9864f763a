"""Identity from a trusted gateway, in process: the keys file's gateway mark,
the one precedence order, the trust rules, bad input, and that admission
and the engine funnel decide the same user (no vLLM server;
tests/e2e/test_gateway.py runs them behind a real LiteLLM proxy).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_output_rate.api_keys import ApiKeys, Principal, digest
from vllm_output_rate.config import ANONYMOUS_USER
from vllm_output_rate.identity import (
    Caller,
    Identity,
    decide,
    user_from_body_fields,
    user_from_header,
)
from vllm_output_rate.integration import trusted_identity
from vllm_output_rate.integration.trusted_identity import (
    IdentityMiddleware,
    IdentityPolicy,
    IdentityRequiredError,
    current_identity,
    identity_at_funnel,
    user_of_api_request,
)
from vllm_output_rate.validation import OutputRateConfigError

HEADER = "x-litellm-end-user-id"
GATEWAY_KEY, ALICE_KEY = "gateway-key", "alice-key"


def keys() -> ApiKeys:
    return ApiKeys(
        {
            "gateway": {"keys": [digest(GATEWAY_KEY)], "gateway": True},
            "alice": [digest(ALICE_KEY)],
        },
        "keys.yaml",
    )


# ----- the keys file ------------------------------------------------------


def test_a_gateway_key_is_marked_in_the_keys_file() -> None:
    table = keys()
    assert table.principal_for(GATEWAY_KEY) == Principal("gateway", gateway=True)
    assert table.principal_for(ALICE_KEY) == Principal("alice", gateway=False)
    assert table.user_for(GATEWAY_KEY) == "gateway"
    assert table.principal_for("guess") is None
    assert table.has_gateway
    assert not ApiKeys({"alice": [digest("k")]}, "f").has_gateway
    # The mapping form without the mark is an ordinary key.
    plain = ApiKeys({"bob": {"keys": [digest("k")]}}, "f")
    assert plain.principal_for("k") == Principal("bob")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"keys": [digest("k")], "gateway": "yes"}, "true or false"),
        ({"keys": [digest("k")], "team": "x"}, "unknown keys"),
        ({"gateway": True}, "list of key digests"),
        ({"keys": ["plain"], "gateway": True}, "sha256"),
    ],
)
def test_a_bad_gateway_entry_is_refused(entry: dict, message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message):
        ApiKeys({"gw": entry}, "keys.yaml")


def test_one_key_cannot_be_both_a_gateway_and_a_user() -> None:
    with pytest.raises(OutputRateConfigError, match="two users"):
        ApiKeys(
            {"gw": {"keys": [digest("k")], "gateway": True}, "bob": [digest("k")]},
            "keys.yaml",
        )


# ----- the one precedence order -------------------------------------------

XARGS = {"output_rate_user": "xargs-user"}


@pytest.mark.parametrize(
    ("caller", "field", "keys_on", "expected"),
    [
        # Without keys, every caller may assert: header, field, xargs, anonymous.
        (Caller(header_user="h"), "f", False, "h"),
        (Caller(), "f", False, "f"),
        (Caller(), None, False, "xargs-user"),
        # A gateway key: header, field, then its own user; never xargs.
        (Caller("gateway", True, "h"), "f", True, "h"),
        (Caller("gateway", True), "f", True, "f"),
        (Caller("gateway", True), None, True, "gateway"),
        # An ordinary key: its own user whatever else the request says.
        (Caller("alice", False, "h"), "f", True, "alice"),
    ],
)
def test_one_precedence_order(
    caller: Caller, field: str | None, keys_on: bool, expected: str
) -> None:
    assert decide(caller, field, XARGS, keys=keys_on) == Identity(expected)


def test_without_any_source_the_request_is_anonymous() -> None:
    assert decide(Caller(), None, None, keys=False) == Identity(ANONYMOUS_USER)
    with pytest.raises(OutputRateConfigError, match="vllm_xargs"):
        decide(Caller(), None, {"output_rate_user": ""}, keys=False)
    # A malformed body name does not matter where a stronger source decides.
    assert decide(Caller(header_user="h"), None, {"output_rate_user": 5}, keys=False)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([b""], "must not be empty"),
        ([b"x" * 10_240], "10240 characters"),
        ([b"eve\x01"], "control character"),
        ([b"eve\tx"], "control character"),
        ([b"\xff\xfe"], "not UTF-8"),
        ([b"alice", b"bob"], "sent 2 times"),
    ],
)
def test_a_malformed_header_is_an_error(values: list[bytes], message: str) -> None:
    with pytest.raises(OutputRateConfigError, match=message):
        user_from_header(values, HEADER)


def test_a_header_names_any_valid_user() -> None:
    assert user_from_header([], HEADER) is None
    assert user_from_header(["Zoë".encode()], HEADER) == "Zoë"
    assert user_from_header([b"a" * 256], HEADER) == "a" * 256


def test_body_fields_are_read_in_the_order_given() -> None:
    request = SimpleNamespace(user="u", safety_identifier="s")
    assert user_from_body_fields(request, ("safety_identifier", "user")) == "s"
    assert user_from_body_fields(request, ("user", "safety_identifier")) == "u"
    assert user_from_body_fields(SimpleNamespace(user=None), ("user",)) is None
    with pytest.raises(OutputRateConfigError, match="user: user name must be a str"):
        user_from_body_fields(SimpleNamespace(user=7), ("user",))


# ----- the middleware: who may assert, and bad input ----------------------


class Holder:
    def __init__(self, policy: IdentityPolicy | None) -> None:
        self.identity_policy = policy


def run_request(
    policy: IdentityPolicy,
    headers: list[tuple[bytes, bytes]],
    body: dict[str, Any] | None = None,
    path: str = "/v1/completions",
) -> tuple[int, dict[str, Any]]:
    """One HTTP request through the middleware to a handler that asks what
    admission (before rendering) and the engine funnel decide, as raw ASGI
    (header bytes exactly as given)."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = SimpleNamespace(**{"vllm_xargs": None, "user": None, **(body or {})})
        try:
            seen["admission"] = user_of_api_request(request)
            seen["funnel"] = identity_at_funnel(
                SamplingParams(extra_args=request.vllm_xargs)
            ).user
            status = 200
        except VLLMValidationError as exc:
            seen["error"], status = str(exc), 400
        except IdentityRequiredError:
            status = 401
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    middleware = IdentityMiddleware(app, Holder(policy))
    previous = trusted_identity.policy
    trusted_identity.policy = policy
    try:
        asyncio.run(middleware(scope, receive, send))
    finally:
        trusted_identity.policy = previous
    start = next(m for m in messages if m["type"] == "http.response.start")
    body_bytes = b"".join(m.get("body", b"") for m in messages[1:])
    seen["body"] = body_bytes.decode()
    return start["status"], seen


def bearer(key: str) -> tuple[bytes, bytes]:
    return (b"authorization", f"Bearer {key}".encode())


def header(value: bytes) -> tuple[bytes, bytes]:
    return (HEADER.encode(), value)


GATEWAY_POLICY = IdentityPolicy(keys=keys(), header=HEADER, body_fields=("user",))


@pytest.mark.parametrize(
    ("headers", "body", "user"),
    [
        ([bearer(GATEWAY_KEY), header(b"bob")], {}, "bob"),
        # Both header and body field: the header wins.
        ([bearer(GATEWAY_KEY), header(b"bob")], {"user": "carol"}, "bob"),
        ([bearer(GATEWAY_KEY)], {"user": "carol"}, "carol"),
        # A gateway key without the header: the gateway's own budget.
        ([bearer(GATEWAY_KEY)], {}, "gateway"),
        # The body's vllm_xargs never names the user with keys on.
        ([bearer(GATEWAY_KEY)], {"vllm_xargs": {"output_rate_user": "x"}}, "gateway"),
        # An ordinary key with the header (or a body field): its own user.
        ([bearer(ALICE_KEY), header(b"bob")], {"user": "carol"}, "alice"),
        # ... and the header is not even read: malformed, it changes nothing.
        ([bearer(ALICE_KEY), header(b"x" * 10_240)], {}, "alice"),
        ([bearer(ALICE_KEY), header(b"a"), header(b"b")], {}, "alice"),
    ],
)
def test_who_may_assert_the_user(
    headers: list[tuple[bytes, bytes]], body: dict, user: str
) -> None:
    status, seen = run_request(GATEWAY_POLICY, headers, body)
    assert status == 200, seen
    # Admission before rendering and the engine funnel agree.
    assert seen["admission"] == seen["funnel"] == user


@pytest.mark.parametrize(
    "bad",
    [
        [header(b"")],
        [header(b"x" * 10_240)],
        [header(b"eve\x01")],
        [header(b"eve\x1b[31m")],
        [header(b"\xc3")],
        [header(b"alice"), header(b"bob")],
    ],
)
def test_a_malformed_header_from_a_gateway_gets_400(
    bad: list[tuple[bytes, bytes]],
) -> None:
    for policy, caller in (
        (GATEWAY_POLICY, [bearer(GATEWAY_KEY)]),
        (IdentityPolicy(header=HEADER), []),  # without keys, anyone asserts
    ):
        status, seen = run_request(policy, caller + bad)
        assert status == 400, seen
        assert "funnel" not in seen and "admission" not in seen  # never reached
        assert HEADER in seen["body"]


def test_a_malformed_body_field_from_a_gateway_gets_400() -> None:
    for user in ("", "x" * 300, "a\nb", 5):
        status, seen = run_request(
            GATEWAY_POLICY, [bearer(GATEWAY_KEY)], {"user": user}
        )
        assert status == 400, seen
        assert "funnel" not in seen
    # From an ordinary key the field is not a source: not even read.
    status, seen = run_request(GATEWAY_POLICY, [bearer(ALICE_KEY)], {"user": ""})
    assert (status, seen["funnel"]) == (200, "alice")


def test_without_a_valid_key_nothing_is_decided() -> None:
    for headers in ([header(b"bob")], [bearer("guess"), header(b"bob")]):
        status, seen = run_request(GATEWAY_POLICY, headers)
        assert status == 401
        assert "funnel" not in seen
    # Outside the guarded prefixes the middleware lets it through and the
    # funnel refuses; admission before rendering checks no one's caps.
    status, seen = run_request(GATEWAY_POLICY, [header(b"bob")], path="/invocations")
    assert status == 401 and seen["admission"] is None


def test_without_keys_the_header_and_fields_come_before_the_body() -> None:
    policy = IdentityPolicy(header=HEADER, body_fields=("safety_identifier", "user"))
    xargs = {"vllm_xargs": {"output_rate_user": "x"}}
    cases = [
        ([header(b"bob")], {"user": "u", **xargs}, "bob"),
        ([], {"user": "u", "safety_identifier": "s", **xargs}, "s"),
        ([], {"user": "u", **xargs}, "u"),
        ([], xargs, "x"),
        ([], {}, ANONYMOUS_USER),
    ]
    for headers, body, user in cases:
        status, seen = run_request(policy, headers, body)
        assert status == 200
        assert seen["admission"] == seen["funnel"] == user, (headers, body)


def test_admission_waits_for_the_funnel_where_the_kind_names_no_user() -> None:
    """A request kind without vllm_xargs (transcriptions): admission cannot
    know the user before rendering unless the header or a field names it."""
    policy = IdentityPolicy(header=HEADER)
    token = current_identity.set(trusted_identity.RequestIdentity(Caller()))
    previous, trusted_identity.policy = trusted_identity.policy, policy
    try:
        assert user_of_api_request(SimpleNamespace()) is None
        named = trusted_identity.RequestIdentity(Caller(header_user="bob"))
        current_identity.set(named)
        assert user_of_api_request(SimpleNamespace()) == "bob"
    finally:
        trusted_identity.policy = previous
        current_identity.reset(token)
