"""Each section's verdicts and figures, from results shaped as its measuring
module returns them, and the measuring helpers whose logic decides a
verdict (no server, no engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.fair_shares import SCENARIOS, engine_shares, opening_order, summarize
from benchmarks.report import accuracy, fair_shares, isolation, speculative, store
from benchmarks.report import throughput as throughput_report
from benchmarks.report.format import judged
from benchmarks.speculative import bound_excess
from harness.bounds import S


def timing(steps: int, schedule_us: float, step_us: float) -> dict[str, float]:
    """One engine's step timing as ``benchmarks.step_timing.read`` gives it."""
    return {
        "steps": steps,
        "schedule_us": schedule_us,
        "vllm_schedule_us": 90.0,
        "update_us": 50.0,
        "bitmask_us": 5.0,
        "engine_step_us": step_us,
    }


def engine(pair: str, ratio: float, labels: tuple[str, str] = ("stock", "ours")):
    """``engine_throughput``'s results for one pair."""
    return {
        "pair": pair,
        "description": "limits far above demand",
        "labels": {"baseline": labels[0], "candidate": labels[1]},
        "rounds": 4,
        "streams": 32,
        "max_tokens": 256,
        "tokens_per_round": 32768,
        "continuous": False,
        "tok_s": {"baseline": [100.0] * 4, "candidate": [100.0 * ratio] * 4},
        "ratios": [ratio - 0.02, ratio, ratio, ratio + 0.02],
        "ratio_median": ratio,
        "ratio_quartiles": [ratio - 0.01, ratio + 0.01],
        "step_timing": {
            "baseline": timing(1000, 100.0, 2000.0),
            "candidate": timing(1000, 110.0, 2010.0),
        },
    }


def test_engine_throughput_is_judged_per_pair(tmp_path: Path) -> None:
    results = {
        "pairs": {
            "plain": engine("plain", 1.01),
            "prompt": engine("prompt", 0.99),
            "hybrid": engine("hybrid", 0.9),
        }
    }
    rows = throughput_report.summary_rows(results)
    assert [(what, met) for what, _, _, met in rows] == [
        ("engine throughput, plain", True),
        ("engine throughput, prompt", True),
        ("engine throughput, hybrid", False),
    ]
    assert throughput_report.headlines(results) == {
        "plain_engine": 1.01,
        "prompt_engine": 0.99,
        "hybrid_engine": 0.9,
    }
    # A run without the prompt pair (older results) has no figure for it.
    del results["pairs"]["prompt"]
    assert throughput_report.headlines(results)["prompt_engine"] is None
    text = throughput_report.section(results, tmp_path / "figs", tmp_path)
    assert "ours / stock **1.010 [1.00-1.02]**" in text
    assert "| `schedule()` | 100.0 | 110.0 |" in text
    # +10 µs over stock's 2,000 µs step; busy time 2,000,000 / 2,010,000.
    assert "+10.0 µs a step against stock's, +0.5%" in text
    assert "0.995" in text
    assert (tmp_path / "figs" / throughput_report.FIGURE).stat().st_size > 0


def store_results(trips: tuple[float, float], engine_ratio: float) -> dict[str, Any]:
    return {
        "round_trips": {
            str(users): {
                "round_trips_per_s": per_s,
                "users_asked_per_s": users / 2,
                "tokens_per_s": 100.0 * users,
                "rtt_mean_ms": 0.2,
            }
            for users, per_s in zip((10, 1000), trips, strict=True)
        },
        "engine": engine("store", engine_ratio, ("ours", "ours with the store")),
    }


def test_the_store_section_judges_each_target(tmp_path: Path) -> None:
    good = store_results((10.0, 10.5), 0.99)
    assert [met for *_, met in store.summary_rows(good)] == [True, True]
    # Round trips that grow with the users (or tokens), an engine 5 % slower.
    bad = store_results((10.0, 20.0), 0.95)
    assert [met for *_, met in store.summary_rows(bad)] == [False, False]
    text = store.section(good, tmp_path, tmp_path)
    assert "| 1000 | 10.5 | 500 | 100000 | 0.20 |" in text
    assert "ours with the store / ours **0.990" in text
    assert store.headlines(good) == {"store_engine": 0.99}


def spec_results(critical: dict[int, float], greedy: float) -> dict[str, Any]:
    def rate(value: float) -> dict[str, Any]:
        rounds = [{"throttled_request_steps": 0.0}]
        return {"rounds": rounds, "rate": value, "min": value, "max": value}

    return {
        "step_cost": {
            f"R={r},U={r // 4}": {
                "critical_ratio": ratio,
                "ours_critical_us": 100.0 * ratio,
                "stock_critical_us": 100.0,
                "step_ratio": ratio + 0.03,
            }
            for r, ratio in critical.items()
        },
        "engine": engine("speculative", 1.02),
        "servers": {
            "acceptance": {
                "greedy": {"ours": rate(0.8 * greedy), "stock": rate(0.8)},
                "temperature 1": {"ours": rate(0.1), "stock": rate(0.2)},
            },
            "accuracy": {
                "at-20": {
                    "limit": 20,
                    "delivered_per_limit": 1.001,
                    "bound_held": True,
                    "bound_excess_tokens": -1.5,
                }
            },
        },
    }


def test_the_speculative_step_is_judged_from_64_requests(tmp_path: Path) -> None:
    # R = 16 reads 1.08 (a fixed cost a step): reported, not judged.
    results = spec_results({16: 1.08, 64: 1.01, 256: 1.02}, greedy=1.0)
    rows = speculative.summary_rows(results)
    assert [met for *_, met in rows] == [True, True, True, True]
    assert rows[0][2] == "schedule() 1.010-1.020"
    assert speculative.headlines(results) == {
        "speculative_engine": 1.02,
        "speculative_step": 1.02,
    }
    worse = spec_results({16: 1.0, 64: 1.06}, greedy=0.9)
    assert [met for *_, met in speculative.summary_rows(worse)] == [
        False,
        True,
        False,
        True,
    ]
    text = speculative.section(results, tmp_path, tmp_path)
    assert "| R=16,U=4 | 1.080 | 108 / 100 | 1.110 | reported |" in text
    assert "| at-20 | 20 | 1.001 | held | -1.500 |" in text


def test_the_bound_excess_counts_tokens_beyond_the_bound() -> None:
    paced = [round(i * 1e9 / 20) for i in range(40)]  # exactly 20 tok/s
    assert bound_excess(paced, 20) == pytest.approx(-2.0)  # the unused burst
    crowded = sorted([*paced, paced[10] + 1, paced[10] + 2, paced[10] + 3])
    assert bound_excess(crowded, 20) == pytest.approx(1.0, abs=1e-6)


def fair_runs(light_share: float, floored_tok_s: float = 60.0) -> list[dict]:
    """One round of each scenario on each server, as ``fair_shares.servers``
    records them: ours with the engine's figures, stock without."""
    runs = []
    for scenario, streams in SCENARIOS.items():
        first, second = streams
        share = {"weights": light_share, "equal": 0.5, "floor": 0.2}[scenario]
        tok_s = floored_tok_s if scenario == "floor" else 300.0 * share
        figures = {
            first: {"tok_s": 300.0 - tok_s, "share": 1 - share},
            second: {"tok_s": tok_s, "share": share},
        }
        runs.append(
            {"scenario": scenario, "server": "stock", "round": 0, "failed": 0}
            | {first: {"tok_s": 290.0, "share": 0.97}}
            | {second: {"tok_s": 10.0, "share": 0.03}, "total_tok_s": 300.0}
        )
        runs.append(
            {"scenario": scenario, "server": "ours", "round": 0, "failed": 0}
            | figures
            | {"total_tok_s": 300.0, "engine": figures | {"window_s": 10.0}}
        )
    return runs


def fair_results(
    runs: list[dict], engine_ratio: float, contested: float = 1.8
) -> dict[str, Any]:
    saturated = engine("saturated", engine_ratio)
    saturated["continuous"] = True
    return {
        "servers": {"runs": runs, "summary": summarize(runs)},
        "engine": saturated,
        "batch_changes": {
            "steps": 3000,
            "stock": {"changes": 46, "kept_steps": None, "largest_gap": 600},
            "ours": {"changes": 229, "kept_steps": 2647, "largest_gap": 20},
        },
        "ranking_cost": {
            "requests": 1024,
            "rounds": 10,
            "subjects": {
                "stock": {"step_ms": 10.0, "ratio": 1.0},
                "U=256": {
                    "step_ms": 10.0 * contested,
                    "ratio": contested,
                    "plugin_calls_per_step": 9271.0,
                },
            },
        },
    }


def test_the_fair_shares_section_judges_each_target(tmp_path: Path) -> None:
    met = fair_results(fair_runs(2 / 3), 0.99, contested=1.25)
    assert [m for *_, m in fair_shares.summary_rows(met)] == [True] * 5
    # light 0.6 is 1.5 : 1, not within 10 % of 2 : 1; the floor 50 < 0.9 x 60;
    # the step 1.8 x stock's where every slot is contested.
    missed = fair_results(fair_runs(0.6, floored_tok_s=50.0), 0.97)
    assert [m for *_, m in fair_shares.summary_rows(missed)] == [
        False,
        True,
        False,
        False,
        False,
    ]
    assert fair_shares.headlines(met) == {
        "saturated_engine": 0.99,
        "contested_step": 1.25,
    }
    assert fair_shares.summary_rows(missed)[-1][2] == "U=256 1.80"
    text = fair_shares.section(met, tmp_path, tmp_path)
    assert "stock 46 times, ours 229" in text
    assert "| U=256 | 12.50 | 1.25 | 9,271 |" in text
    assert "| stock | 10.00 | 1.00 | - |" in text  # results before the count
    assert "streams kept busy" in text


def test_a_failed_request_on_ours_fails_its_verdict() -> None:
    runs = fair_runs(2 / 3)
    next(r for r in runs if r["server"] == "ours")["failed"] = 1
    rows = fair_shares.summary_rows(fair_results(runs, 0.99))
    assert rows[0][3] is False


def test_ours_is_judged_at_the_engine_while_every_user_was_served() -> None:
    start, ms = 10 * S, S // 1000
    dispatched = {
        # every 10 ms through the 1 s window, and one before it
        "many": [start + k * 10 * ms for k in range(101)] + [start - 5],
        # every 5 ms until its requests end at 0.5 s (and one after the window)
        "light": [start + k * 5 * ms for k in range(101)] + [start + 3 * S],
    }
    shares = engine_shares(dispatched, ["many", "light"], start, start + S)
    assert shares["window_s"] == pytest.approx(0.5)
    assert shares["many"]["tok_s"] == pytest.approx(102)  # 51 tokens in 0.5 s
    assert shares["light"]["share"] == pytest.approx(101 / 152)
    # A user never served is judged over the whole window: its share is 0.
    alone = engine_shares({"many": [start + 1]}, ["many", "light"], start, start + S)
    assert alone["window_s"] == pytest.approx(1.0)
    assert alone["light"]["share"] == 0.0


def test_the_judged_users_streams_open_first() -> None:
    assert opening_order(SCENARIOS["floor"]) == ["floored", "hog"]
    assert opening_order({"warm-up": 2}) == ["warm-up"]


def accuracy_row(limit: float, engine_ratio: float | None, **extra: Any) -> dict:
    return {
        "limit": limit,
        "streams": 4,
        "tokens": 400,
        "client_ratio": 1.004,
        "engine_ratio": engine_ratio,
        "bound_ok": True,
        "demand_exceeds_limit": True,
        "engine": {"gap_p50_ms": 50.0, "gap_p99_ms": 60.0, "ideal_gap_ms": 50.0},
    } | extra


def test_accuracy_judges_the_engine_rate_where_demand_exceeds_the_limit(
    tmp_path: Path,
) -> None:
    assert accuracy.cell_met(accuracy_row(20, 1.004)) is True
    assert accuracy.cell_met(accuracy_row(20, 1.026)) is False  # 1.03 rounded
    assert accuracy.cell_met(accuracy_row(20, 1.0, bound_ok=False)) is False
    assert accuracy.cell_met(accuracy_row(500, 0.7, demand_exceeds_limit=False)) is None
    results = {
        "duration_s": 20.0,
        "batches": [["acc-20x4"], ["acc-500x4"]],
        "batch_demand_cap": 500.0,
        "max_tokens_cap": 3500,
        "skip_s": 1.0,
        "demand_margin": 1.5,
        "probe_tok_s": [900.0, 400.0],
        "rows": [
            accuracy_row(20, 0.998),
            accuracy_row(500, 0.7, demand_exceeds_limit=False),
        ],
        "dispatch_log_read": True,
    }
    ((*_, met),) = accuracy.summary_rows(results)
    assert met is True
    assert accuracy.headlines(results) == {"accuracy": 0.998}
    text = accuracy.section(results, tmp_path, tmp_path)
    assert "1 of 1 judged cells" in text
    assert "n.a. (demand < limit)" in text


def test_isolation_judges_b_beside_a(tmp_path: Path) -> None:
    def summary(ratio: float) -> dict[str, Any]:
        return {"tok_s_ratio": ratio, "ttft_ratio": 1.5, "a_tok_s_while_b": 320.0}

    def run(server: str, beside: float) -> dict[str, Any]:
        b = {"tok_s": beside, "ttft_p50_ms": 80.0}
        alone = {"tok_s": 100.0, "ttft_p50_ms": 50.0}
        return {"round": 0, "server": server, "alone": alone, "beside": b}

    results = {
        "rounds": 1,
        "duration_s": 8.0,
        "lead_s": 3.0,
        "max_tokens": 256,
        "a_streams": 32,
        "a_limit": 10.0,
        "b_limit": 10_000.0,
        "runs": [
            run("stock", 30.0)
            | {"tok_s_ratio": 0.3, "ttft_ratio": 9.0}
            | {"a_tok_s_while_b": 900.0},
            run("ours", 95.0)
            | {"tok_s_ratio": 0.95, "ttft_ratio": 1.6}
            | {"a_tok_s_while_b": 320.0},
        ],
        "summary": {"stock": summary(0.3), "ours": summary(0.95)},
    }
    assert [met for *_, met in isolation.summary_rows(results)] == [True]
    assert isolation.headlines(results) == {"isolation": 0.95}
    text = isolation.section(results, tmp_path, tmp_path)
    assert "**With limits, B beside A / B alone: 0.950**" in text
    assert "| ours | 1 | 100 | 95 | 0.950 | 50 | 80 | 1.60 | 320 |" in text
    results["summary"]["ours"]["tok_s_ratio"] = 0.85
    assert [met for *_, met in isolation.summary_rows(results)] == [False]


def test_judged_adds_digits_only_where_the_rounding_reads_as_the_bar() -> None:
    assert judged(0.9512, 0.98) == "0.951"
    assert judged(0.97963, 0.98) == "0.9796"
    assert judged(1.30004, 1.3) == "1.30004"
    assert judged(0.98, 0.98) == "0.980"
    assert judged(0.9799999999, 0.98) == "0.980000"  # at most 6 decimals
