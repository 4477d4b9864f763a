"""The batch-change count of the fair-shares section (``benchmarks.batch_changes``), on
vLLM's real scheduler: what it counts must be what the schedulers do."""

from __future__ import annotations

from benchmarks import batch_changes
from benchmarks.kinds import SATURATED_LIMITS, SATURATED_USERS
from vllm_output_rate.scheduling.fair_share import PREFILL_TOKEN_COST, TURN_TOKENS

STEPS = 400


def test_stock_changes_its_batch_only_as_requests_end(tiny_model_path: str) -> None:
    stock = batch_changes.count(tiny_model_path, ours=False, steps=STEPS)
    # FCFS runs the three active requests to their end together: one change
    # per request length, and the first user's streams get every slot.
    assert stock["changes"] <= STEPS // batch_changes.MAX_TOKENS + 1
    assert stock["changes"] >= STEPS // batch_changes.MAX_TOKENS - 1
    assert stock["kept_steps"] is None
    assert stock["largest_gap"] >= batch_changes.MAX_TOKENS


def test_ours_shares_the_slots_and_changes_its_batch_rarely(
    tiny_model_path: str,
) -> None:
    ours = batch_changes.count(tiny_model_path, ours=True, steps=STEPS)
    active = SATURATED_LIMITS["max_num_active_seqs"]
    # Requests ending (active / MAX_TOKENS a step, each a change at most) plus
    # the third slot passing between the users, about once per 2 x TURN_TOKENS
    # steps: far from the 2.98 new requests a step of ranking without turns.
    ends = STEPS * active // batch_changes.MAX_TOKENS
    assert ours["changes"] <= ends + STEPS // TURN_TOKENS
    assert ours["kept_steps"] >= STEPS * 3 // 4
    assert sum(ours["scheduled"].values()) >= active * STEPS - active
    # The bound (docs/architecture.md, "Fair shares"): D + TURN_TOKENS, D the
    # most one step charges a user (a token and its prompt).
    bound = 1 + PREFILL_TOKEN_COST * batch_changes.PROMPT_TOKENS + TURN_TOKENS
    assert ours["largest_gap"] <= bound
    assert set(ours["scheduled"]) == set(SATURATED_USERS)
