"""The cap arithmetic, Retry-After and the rate-limit headers (pure)."""

from __future__ import annotations

import math

import pytest

from vllm_output_rate.admission_caps import (
    DEFAULT_REQUESTS_KEY,
    DEFAULT_TOKENS_KEY,
    MIN_RETRY_S,
    OWN_REQUESTS,
    OWN_TOKENS,
    REQUESTS_KEY,
    TOKENS_KEY,
    Caps,
    GlobalCaps,
    UserView,
    caps_from_document,
    format_duration,
    merge_views,
    parse_user_caps,
    rate_limit_headers,
    refusal,
    retry_after_s,
    retry_headers,
    validate_cap,
)
from vllm_output_rate.validation import OutputRateConfigError

NO_GLOBAL = GlobalCaps()


# ----- validation -------------------------------------------------------------


@pytest.mark.parametrize("good", [1, 7, 2**31, 4.0])
def test_whole_numbers_from_one_are_caps(good: object) -> None:
    assert validate_cap(good, "cap") == int(good)  # type: ignore[call-overload]


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True, None, math.nan, math.inf])
def test_anything_else_is_refused_naming_where(bad: object) -> None:
    with pytest.raises(OutputRateConfigError, match="--my-flag must be a whole"):
        validate_cap(bad, "--my-flag")


def test_a_cap_above_the_global_cap_is_refused() -> None:
    with pytest.raises(OutputRateConfigError, match="above the server's own cap"):
        validate_cap(17, "cap", 16, "--max-num-queued-reqs")
    assert validate_cap(16, "cap", 16, "--max-num-queued-reqs") == 16


def test_user_caps_parse_json_text_and_name_the_bad_user() -> None:
    assert parse_user_caps('{"a": 2, "b": 3}', "--f") == {"a": 2, "b": 3}
    with pytest.raises(OutputRateConfigError, match="cap of user 'b'"):
        parse_user_caps({"a": 2, "b": 0}, "--f")
    with pytest.raises(OutputRateConfigError, match="not valid JSON"):
        parse_user_caps("{a: 2", "--f")
    with pytest.raises(OutputRateConfigError, match="expected a JSON object"):
        parse_user_caps("[1]", "--f")
    with pytest.raises(OutputRateConfigError, match="user name must not be empty"):
        parse_user_caps({"": 2}, "--f")


def test_a_document_sets_defaults_and_users_and_updates_keep_the_rest() -> None:
    caps = caps_from_document(
        {DEFAULT_REQUESTS_KEY: 8, REQUESTS_KEY: {"hog": 2}, TOKENS_KEY: {"b": 500}},
        NO_GLOBAL,
    )
    assert caps.requests_of("hog", NO_GLOBAL) == 2
    assert caps.requests_of("anyone", NO_GLOBAL) == 8
    assert caps.tokens_of("b", NO_GLOBAL) == 500
    assert caps.tokens_of("anyone", NO_GLOBAL) is None
    changed = caps.updated(
        {DEFAULT_TOKENS_KEY: 1000, REQUESTS_KEY: {"c": 3}}, NO_GLOBAL
    )
    assert changed.requests == {"hog": 2, "c": 3}
    assert changed.default_requests == 8 and changed.default_tokens == 1000
    removed = changed.updated({}, NO_GLOBAL, remove_users=["hog", "b"])
    assert removed.requests == {"c": 3} and removed.tokens == {}
    assert removed.users == {"c"}
    # A bad key changes nothing and names the key.
    with pytest.raises(OutputRateConfigError, match="request body: user_max_con"):
        caps.updated({REQUESTS_KEY: {"x": -1}}, NO_GLOBAL, "request body")


def test_without_defaults_of_its_own_the_global_caps_apply() -> None:
    global_caps = GlobalCaps(requests=16, tokens=4096)
    caps = Caps()
    assert caps.requests_of("u", global_caps) == 16
    assert caps.tokens_of("u", global_caps) == 4096
    assert caps.requests_of("u", NO_GLOBAL) is None
    with pytest.raises(OutputRateConfigError, match="--max-num-queued-tokens 4096"):
        caps.updated({TOKENS_KEY: {"u": 5000}}, global_caps)


def test_pages_carry_their_users_caps_only() -> None:
    caps = Caps(2, {"a": 1, "b": 3}, None, {"b": 10})
    assert caps.page(["b"]) == {
        DEFAULT_REQUESTS_KEY: 2,
        REQUESTS_KEY: {"b": 3},
        DEFAULT_TOKENS_KEY: None,
        TOKENS_KEY: {"b": 10},
    }


# ----- refusals ---------------------------------------------------------------


def test_a_user_below_its_caps_is_admitted() -> None:
    assert refusal(1, 4, 1000, own_requests=3, own_queued_tokens=999) is None
    assert refusal(5, None, None, 10**6, 10**9) is None


def test_the_users_own_excess_gets_429() -> None:
    refused = refusal(1, 4, None, own_requests=4, own_queued_tokens=0)
    assert refused is not None and (refused.status, refused.reason) == (
        429,
        OWN_REQUESTS,
    )
    assert "4 requests in flight" in refused.message
    # n counts n sequences.
    refused = refusal(2, 4, None, own_requests=3, own_queued_tokens=0)
    assert refused is not None and refused.status == 429


def test_n_above_the_cap_can_never_pass_and_gets_400() -> None:
    refused = refusal(5, 4, None, own_requests=0, own_queued_tokens=0)
    assert refused is not None and refused.status == 400
    assert "n=5" in refused.message


def test_the_token_cap_refuses_once_reached_like_vllms() -> None:
    # A long prompt is admitted while nothing is queued ...
    assert refusal(1, None, 100, 0, own_queued_tokens=0) is None
    assert refusal(1, None, 100, 1, own_queued_tokens=99) is None
    # ... and the next one waits once the queue reached the cap.
    refused = refusal(1, None, 100, 1, own_queued_tokens=100)
    assert refused is not None and refused.reason == OWN_TOKENS


# ----- Retry-After ------------------------------------------------------------


def test_retry_after_is_when_the_first_request_finishes_at_the_users_rate() -> None:
    # 8 requests take turns at 5 tok/s; the one closest to done has 10 left:
    # 8 x 10 / 5 = 16 s, after a GCRA wait of 0.2 s, plus the margin.
    view = UserView(limit=5, rate=5, wait_s=0.2, requests=8, min_remaining=10)
    assert retry_after_s(view, OWN_REQUESTS, 8) == pytest.approx(16.2 * 1.1)
    # Queued prompt tokens: one round of turns.
    assert retry_after_s(view, OWN_TOKENS, 8) == pytest.approx((0.2 + 8 / 5) * 1.1)


def test_before_the_engines_see_its_requests_they_are_as_long_as_this_one() -> None:
    # 16 requests just admitted, none in the engines' view yet; the refused
    # one asks for 10 tokens: 16 x 10 / 20 = 8 s.
    view = UserView(limit=20, rate=20)
    assert retry_after_s(view, OWN_REQUESTS, 16, assumed_remaining=10) == (
        pytest.approx(8 * 1.1)
    )


def test_retry_after_has_a_floor_and_a_fallback() -> None:
    fast = UserView(limit=1000, rate=1000, requests=1, min_remaining=1)
    assert retry_after_s(fast, OWN_REQUESTS, 1) == MIN_RETRY_S
    assert retry_after_s(None, OWN_REQUESTS, 3) == MIN_RETRY_S


def test_retry_headers_round_up_whole_seconds_and_milliseconds() -> None:
    assert retry_headers(1.2345) == {"retry-after": "2", "retry-after-ms": "1235"}
    assert retry_headers(0.0) == {"retry-after": "1", "retry-after-ms": "1"}


# ----- headers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0ms"),
        (0.0171, "18ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.9985, "59.999s"),
        (59.9994, "1m0s"),
        (60, "1m0s"),
        (90.25, "1m30.25s"),
        (3725, "1h2m5s"),
    ],
)
def test_durations_read_like_openais(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_token_headers_are_per_minute_and_count_what_the_user_owes() -> None:
    # 100 tok/s is 6,000 a minute. It owes 300 tokens (three requests' rest)
    # plus 50 of this request, plus 0.5 s of GCRA wait (50 tokens).
    view = UserView(limit=100, rate=100, wait_s=0.5, requests=3, outstanding=300)
    headers = rate_limit_headers(view, new_tokens=50)
    assert headers == {
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": str(6000 - 400),
        "x-ratelimit-reset-tokens": "4s",
    }


def test_an_idle_user_has_its_whole_minute() -> None:
    headers = rate_limit_headers(UserView(limit=2.5, rate=2.5))
    assert headers["x-ratelimit-limit-tokens"] == "150"
    assert headers["x-ratelimit-remaining-tokens"] == "150"
    assert headers["x-ratelimit-reset-tokens"] == "0ms"


def test_remaining_never_goes_below_zero() -> None:
    view = UserView(limit=1, rate=1, requests=1, outstanding=500)
    headers = rate_limit_headers(view)
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "8m20s"


def test_request_headers_only_with_a_cap() -> None:
    view = UserView(limit=5, rate=5)
    assert "x-ratelimit-limit-requests" not in rate_limit_headers(view)
    headers = rate_limit_headers(
        view, requests_cap=4, own_requests=3, requests_reset_s=12.0
    )
    assert headers["x-ratelimit-limit-requests"] == "4"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-reset-requests"] == "0ms"  # a slot is free now
    full = rate_limit_headers(view, requests_cap=4, own_requests=4, requests_reset_s=12)
    assert full["x-ratelimit-remaining-requests"] == "0"
    assert full["x-ratelimit-reset-requests"] == "12s"


def test_views_of_several_engines_add_up() -> None:
    a = UserView(
        limit=10, rate=6, wait_s=0.3, requests=3, outstanding=30, min_remaining=4
    )
    b = UserView(
        limit=10, rate=4, wait_s=0.1, requests=1, outstanding=5, min_remaining=5
    )
    idle = UserView(limit=10, rate=10)
    merged = merge_views([a, b, idle])
    assert merged == UserView(
        limit=10, rate=10, wait_s=0.1, requests=4, outstanding=35, min_remaining=4
    )
    assert merged.paused
    assert merge_views([idle]) is idle
    assert merge_views([]) is None
