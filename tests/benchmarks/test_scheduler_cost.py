"""The scheduler-cost benchmark, on its smallest configuration only.

No timing is asserted (the machines are noisy); what is checked is that the
result has the documented shape and that every state measured is the state
claimed: the benchmark itself raises if a timed step dispatched a different
number of requests than its state implies.
"""

from __future__ import annotations

import pytest

from benchmarks import scheduler_cost
from benchmarks.report import scheduler_cost as report

R = 64


@pytest.fixture(scope="module")
def results(tiny_model_path: str) -> dict:
    return scheduler_cost.run(
        quick=True,
        sizes=(R,),
        user_counts=(1, 16),
        rounds=3,
        model_path=tiny_model_path,
    )


def test_one_row_per_state_and_user_count(results: dict) -> None:
    keys = sorted((r["state"], r["U"]) for r in results["rows"])
    # Half of one user is not a state: (c) only runs with U >= 2.
    assert keys == [
        ("a", 1),
        ("a", 16),
        ("b", 1),
        ("b", 16),
        ("c", 16),
        ("r", 1),
        ("r", 16),
    ]
    assert [s["R"] for s in results["stock"]] == [R]
    for row in results["rows"]:
        assert row["R"] == R
        assert row["steps"] == 3
        for key in ("ours_us", "stock_us", "ours_update_us", "stock_update_us"):
            assert row[key] > 0
        assert row["ratio"] > 0
        assert row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]


def test_the_states_are_the_ones_claimed(results: dict) -> None:
    stock = results["stock"][0]
    assert stock["scheduled_per_step"] == R
    for row in results["rows"]:
        decoding = {"a": R, "b": 0, "c": R // 2, "r": R}[row["state"]]
        assert row["scheduled_per_step"] == decoding
        assert row["throttled_per_step"] == R - decoding


def test_limiter_calls_grow_with_users_not_requests(results: dict) -> None:
    calls = {(r["state"], r["U"]): r["limiter_calls_per_step"] for r in results["rows"]}
    for (_, users), per_step in calls.items():
        # A take and a refund (or a ready_at) per user, plus at most one
        # periodic cleanup in the counted steps; never one per request.
        assert 0 < per_step <= 2 * users + 1
    targets = results["targets"]
    assert set(targets) == {
        "a_within_5_percent_of_stock",
        "limiter_calls_grow_with_U_not_R",
        "b_not_above_stock",
        "r_reference_path",
    }
    assert targets["limiter_calls_grow_with_U_not_R"]["met"]
    assert targets["r_reference_path"]["met"] is None  # reported, not judged


def test_markdown_and_plot(results: dict, tmp_path) -> None:
    text = report.section(results, tmp_path / "docs", tmp_path)
    assert (tmp_path / "docs" / report.FIGURE).stat().st_size > 0
    assert f"![µs per schedule() against R](docs/{report.FIGURE})" in text
    for state, title in scheduler_cost.STATES.items():
        assert f"### ({state}) {title}" in text
    assert "| R | U |" in text
    assert f"| {R} | 16 |" in text
    assert "### Targets" in text
