"""The store (7) and speculative decoding (8) sections, from results shaped
as ``benchmarks.store.run`` and ``benchmarks.speculative.run`` return them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import speculative, store


def store_results(ratio: float) -> dict[str, Any]:
    return {
        "accuracy": {
            "split 3:1": {
                "limit": 100.0,
                "streams": [3, 1],
                "delivered_per_engine": [1500, 500],
                "ratio": ratio,
                "max_in_1s_window": 111,
                "bound_1s": 112.0,
            }
        },
        "round_trips": {
            str(users): {
                "round_trips_per_s": 10.0,
                "users_asked_per_s": users / 2,
                "tokens_per_s": 100.0 * users,
                "rtt_mean_ms": 0.2,
            }
            for users in (10, 100, 1000)
        },
        "step_cost": {
            "users": 10_000,
            "local_ms": 10.0,
            "store_ms": 10.4,
            "ratio": 1.04,
        },
    }


def test_the_store_section_judges_each_target(tmp_path: Path) -> None:
    rows = store.summary_rows(store_results(1.0))
    assert [met for *_, met in rows] == [True, True, None]
    assert store.summary_rows(store_results(0.9))[0][3] is False
    text = store.section(store_results(1.0), tmp_path, tmp_path)
    assert text.startswith("## 7. Several engines sharing a store")
    assert "| split 3:1 | 100 | 3/1 | 1500/500 | 1.000 | 111 (112) |" in text


def speculative_results(delivered: float, bound_held: bool) -> dict[str, Any]:
    figures = {
        "acceptance": {"greedy": 0.80, "temperature 1": 0.40},
        "throughput_tok_s": 1000.0,
    }
    return {
        "step_cost": {"R=64": {"ratio": 1.01, "ours_us": 101.0, "stock_us": 100.0}},
        "servers": {
            "stock": figures,
            "ours": {**figures, "throughput_tok_s": 990.0},
            "accuracy": {
                "at-20": {
                    "limit": 20,
                    "delivered_per_limit": delivered,
                    "bound_held": bound_held,
                }
            },
        },
    }


def test_the_speculative_section_judges_each_target(tmp_path: Path) -> None:
    rows = speculative.summary_rows(speculative_results(1.004, True))
    assert [met for *_, met in rows] == [True, True, True, True]
    broken = speculative.summary_rows(speculative_results(1.004, False))
    assert broken[-1][3] is False
    fast = speculative.summary_rows(speculative_results(1.05, True))
    assert fast[-1][3] is False
    text = speculative.section(speculative_results(1.0, True), tmp_path, tmp_path)
    assert text.startswith("## 8. Speculative decoding")
    assert "ours 0.800, stock 0.800 (ratio 1.000)" in text
    assert "bound held" in text
