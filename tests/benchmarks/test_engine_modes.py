"""The engine-modes benchmark's measuring code, on vLLM's real scheduler."""

from __future__ import annotations

from benchmarks import engine_modes


def test_a_limited_hybrid_user_keeps_its_limit_and_the_accounts(
    tiny_model_path: str,
) -> None:
    result = engine_modes.accuracy(
        tiny_model_path, engine_modes.MODES["hybrid (Mamba state group)"], 3.0
    )
    assert 1.0 <= round(result["delivered_per_limit"], 2) <= 1.02, result
    assert result["bound_held"] and result["charges_equal_tokens"]
    # 4 streams, one token each per 5 ms step, as with the engine to itself.
    assert result["free_tok_s"] == result["free_alone_on_stock_tok_s"] > 700


def test_the_step_cost_pairs_stock_and_ours_with_the_mode_on(
    tiny_model_path: str,
) -> None:
    cost = engine_modes.step_cost(
        tiny_model_path, engine_modes.MODES["LoRA (4 adapters)"], rounds=8
    )
    assert cost["ours_us"] > 0 and cost["stock_us"] > 0
    assert cost["quartiles"][0] <= cost["ratio"] <= cost["quartiles"][1]
