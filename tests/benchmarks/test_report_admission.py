"""The admission section renders what ``benchmarks.admission.run`` returns,
and judges the light user's answer and the hog's (never 503)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import admission

RESULTS = {
    "check_cost": [
        {"in_flight": 0, "stock_us": 0.56, "ours_us": 3.8, "ours_with_headers_us": 8.6},
        {
            "in_flight": 1000,
            "stock_us": 34.0,
            "ours_us": 42.0,
            "ours_with_headers_us": 47.0,
        },
    ],
    "throughput": {
        "rates_tok_s": {"stock": [900.0, 1000.0], "ours": [910.0, 990.0]},
        "ours_over_stock": {"median": 1.0, "min": 0.99, "max": 1.01},
        "ours_over_ours_without_admission": 1.02,
    },
    "reproduction": {
        "stock": {
            "light": {"status": 200, "first_token_s": 0.11, "last_token_s": 0.3},
            "hog_answers_by_status": {"200": 24},
        },
        "ours": {
            "light": {"status": 200, "first_token_s": 0.11, "last_token_s": 0.88},
            "hog_answers_by_status": {"429": 8},
        },
    },
}


def test_the_section_renders_every_figure(tmp_path: Path) -> None:
    text = admission.section(RESULTS, tmp_path, tmp_path)
    assert "| 1,000 | 34.00 | 42.00 | 47.00 |" in text
    assert "ours / stock 1.000" in text
    assert "| ours | 200 | 0.11 | 0.88 | {'429': 8} |" in text
    assert admission.headlines(RESULTS) == {"admission_server": 1.0}


def test_a_503_to_the_hog_or_a_refused_light_user_misses() -> None:
    assert all(met for *_, met in admission.summary_rows(RESULTS))
    ours = RESULTS["reproduction"]["ours"]
    for light, hog in ((503, {"429": 8}), (200, {"429": 7, "503": 1})):
        broken = {
            **RESULTS,
            "reproduction": {
                "ours": {
                    **ours,
                    "light": {**ours["light"], "status": light},
                    "hog_answers_by_status": hog,
                }
            },
        }
        assert not admission.summary_rows(broken)[1][3]


def test_a_ratio_just_below_its_bar_does_not_read_as_the_bar() -> None:
    below = {**RESULTS["throughput"], "ours_over_stock": {"median": 0.97963}}
    (row, _) = admission.summary_rows({**RESULTS, "throughput": below})
    assert row[2:] == ("0.9796", False)
    at = {**RESULTS["throughput"], "ours_over_stock": {"median": 0.98}}
    (row, _) = admission.summary_rows({**RESULTS, "throughput": at})
    assert row[2:] == ("0.980", True)
