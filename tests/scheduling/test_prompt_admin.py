"""Prompt-token rates changed live, as the admin API does (``update_limits``,
``limits_page``), on vLLM's real scheduler with a fake clock: a change binds
from the next step, ``remove_users`` drops a user's prompt rate too, prompt
rates are paged with the other limits, and a server without prompt
limiting refuses them whole."""

from __future__ import annotations

import pytest

from harness.bounds import MS, assert_window_bound
from vllm_output_rate.limits_update import PROMPT_OFF
from vllm_output_rate.validation import OutputRateConfigError

STEP_NS = 10 * MS
FAR = 1e6  # tok/s: a rate that never binds
PROMPT_DEFAULT = "default_user_prompt_tokens_per_second"
PROMPT_USERS = "user_prompt_tokens_per_second"


def test_a_live_prompt_rate_change_binds_from_the_next_step(limited) -> None:
    h = limited(FAR, prompt={"default": FAR}, max_num_batched_tokens=512)
    policy = h.scheduler.output_rate
    for _ in range(40):
        h.add("hog", prompt_len=900, max_tokens=2)
    for _ in range(5):
        h.step(STEP_NS)
    changed_at = h.clock.now_ns  # the last step before the change ran then
    before = len(h.prompt_token_times("hog"))
    assert before >= 5 * 500  # unbound: about a full step of prompt each
    policy.update_limits({PROMPT_USERS: {"hog": 2_000.0}})
    assert policy.limits()[PROMPT_USERS] == {"hog": 2_000.0}
    for _ in range(100):
        h.step(STEP_NS)
    after = [t for t in h.prompt_token_times("hog") if t > changed_at]
    assert_window_bound(after, 2_000.0)  # no burst granted by the change
    assert len(after) >= 2_000 * 0.9  # ~1 s at its new rate

    # Removed: back to the default prompt rate, which does not bind.
    policy.update_limits({"remove_users": ["hog"]})
    assert policy.limits()[PROMPT_USERS] == {}
    done = len(h.prompt_token_times("hog"))
    for _ in range(20):
        h.step(STEP_NS)
    assert len(h.prompt_token_times("hog")) - done >= 20 * 400
    h.run_until_done(STEP_NS)


def test_the_default_prompt_rate_changes_for_everyone_without_one(limited) -> None:
    h = limited(FAR, prompt={"default": FAR, "vip": FAR})
    policy = h.scheduler.output_rate
    policy.update_limits({PROMPT_DEFAULT: 3_000.0})
    limits = policy.limits()
    assert limits[PROMPT_DEFAULT] == 3_000.0
    assert limits[PROMPT_USERS] == {"vip": FAR}
    assert "prompt tokens: default 3000 tok/s" in policy.limits_summary()


def test_prompt_rates_are_paged_with_the_other_limits(limited) -> None:
    h = limited(50, prompt={"default": 5_000.0})
    policy = h.scheduler.output_rate
    policy.update_limits(
        {
            "user_output_tokens_per_second": {"a": 5, "c": 7},
            PROMPT_USERS: {"b": 100.0, "c": 200.0, "d": 300.0},
        }
    )
    first = policy.limits_page(2)
    assert first["total"] == 4 and first["next"] == "b"
    assert first["limits"][PROMPT_USERS] == {"b": 100.0}
    assert first["limits"][PROMPT_DEFAULT] == 5_000.0
    second = policy.limits_page(2, first["next"])
    assert second["limits"][PROMPT_USERS] == {"c": 200.0, "d": 300.0}
    assert second["limits"]["user_output_tokens_per_second"] == {"c": 7}
    assert second["next"] is None


def test_without_prompt_limiting_prompt_rates_are_refused_whole(limited) -> None:
    h = limited(50)
    policy = h.scheduler.output_rate
    with pytest.raises(OutputRateConfigError) as refused:
        policy.update_limits(
            {"user_output_tokens_per_second": {"a": 5}, PROMPT_USERS: {"a": 100.0}}
        )
    assert str(refused.value) == PROMPT_OFF
    limits = policy.limits()
    assert limits["user_output_tokens_per_second"] == {}  # nothing applied
    assert PROMPT_DEFAULT not in limits and PROMPT_USERS not in limits


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({PROMPT_DEFAULT: 0}, "finite number > 0"),
        ({PROMPT_USERS: {"a": -1}}, "got -1"),
        ({PROMPT_USERS: ["a"]}, PROMPT_USERS),
    ],
)
def test_bad_prompt_rates_name_their_key(limited, body: dict, message: str) -> None:
    h = limited(50, prompt={"default": 5_000.0})
    with pytest.raises(OutputRateConfigError, match=message):
        h.scheduler.output_rate.update_limits(body)
    assert h.scheduler.output_rate.limits()[PROMPT_DEFAULT] == 5_000.0
