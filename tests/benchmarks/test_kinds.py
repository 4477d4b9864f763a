"""The engine pairs as data (``benchmarks.kinds``): what each side's engine
is started with (``engine_throughput.engine_args``)."""

from __future__ import annotations

import pytest

from benchmarks.engine_throughput import engine_args
from benchmarks.kinds import FAR_LIMIT, PAIRS, SPECULATION, STORE_URL_ENV, WEIGHTS


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_two_sides_differ_only_in_the_plugins_configuration(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORE_URL_ENV, "redis://127.0.0.1:1/0")
    pair = PAIRS[name]
    base, cand = (engine_args(pair, side) for side in (pair.baseline, pair.candidate))
    assert base.pop("additional_config", None) != cand.pop("additional_config")
    assert base == cand


def test_stock_loads_no_plugin_and_ours_limits_far_above_demand() -> None:
    plain = PAIRS["plain"]
    assert not plain.baseline.plugin
    assert "additional_config" not in engine_args(plain, plain.baseline)
    ours = engine_args(plain, plain.candidate)["additional_config"]["output_rate"]
    assert ours == {"default_user_output_tokens_per_second": FAR_LIMIT}


def test_the_saturated_and_speculative_pairs_carry_their_settings() -> None:
    saturated = PAIRS["saturated"]
    args = engine_args(saturated, saturated.candidate)
    assert (args["max_num_seqs"], args["max_num_active_seqs"]) == (40, 3)
    assert args["additional_config"]["output_rate"]["user_output_weight"] == WEIGHTS
    assert saturated.load.continuous
    speculative = PAIRS["speculative"]
    assert engine_args(speculative, speculative.baseline)["speculative_config"] == (
        SPECULATION
    )
    assert speculative.greedy and speculative.variant == "echo"


def test_the_store_side_leases_from_the_url_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = PAIRS["store"]
    monkeypatch.setenv(STORE_URL_ENV, "redis://127.0.0.1:1/0")
    section = engine_args(store, store.candidate)["additional_config"]["output_rate"]
    assert section["store_url"] == "redis://127.0.0.1:1/0"
    assert (
        "store_url"
        not in engine_args(store, store.baseline)["additional_config"]["output_rate"]
    )


def test_the_prompt_pair_counts_prompt_work_that_never_binds() -> None:
    from benchmarks.engine_throughput import distinct_prompts

    pair = PAIRS["prompt"]
    ours = engine_args(pair, pair.candidate)["additional_config"]["output_rate"]
    assert ours["default_user_prompt_tokens_per_second"] == FAR_LIMIT
    assert len(set(pair.load.users)) == 16 and pair.load.prompt_len == 512
    prompts = distinct_prompts(32, 512)
    ids = [p["prompt_token_ids"] for p in prompts]
    assert all(len(p) == 512 and min(p) > 0 and max(p) < 512 for p in ids)
    # No two share a first block (16 tokens): no prefix cache serves them.
    assert len({tuple(p[:16]) for p in ids}) == 32
