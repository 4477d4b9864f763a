"""The prefill section renders what ``benchmarks.prefill.run`` returns and
judges its two targets: the light user's TTFT beside the hog within 2x of
alone, and the step cost within 1.05x of stock's."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import prefill


def server(alone_s: float, beside_s: float) -> dict:
    figures = {"ttft_p50_s": 0.0, "ttft_p95_s": 0.0, "latency_p50_s": 0.0}
    return {
        "alone": {**figures, "ttft_p50_s": alone_s, "ttft_p95_s": 2 * alone_s},
        "beside": {**figures, "ttft_p50_s": beside_s, "ttft_p95_s": 2 * beside_s},
        "ttft_p50_ratio": beside_s / alone_s,
        "ttft_p95_ratio": beside_s / alone_s,
        "latency_p50_ratio": 4.0,
        "hog_answers_per_s": 30.0,
    }


def results(ours_beside_s: float, cost: float) -> dict:
    return {
        "hog_streams": 16,
        "light_requests": 40,
        "servers": {
            "stock": server(0.010, 0.600),
            "ours": server(0.010, ours_beside_s),
        },
        "step_cost": {
            "users": 1000,
            "prompt_tokens": 1500,
            "step_tokens": 8192,
            "rounds": 60,
            "shared_steps": 60,
            "subjects": {
                "stock": {"step_ms": 1.0, "ratio": 1.0},
                "ours": {"step_ms": cost, "ratio": cost},
            },
        },
    }


def test_the_section_renders_every_figure(tmp_path: Path) -> None:
    text = prefill.section(results(0.015, 1.02), tmp_path, tmp_path)
    assert "| stock | 10 | 600 | 20 | 1,200 |" in text
    assert "| ours | 10 | 15 | 20 | 30 |" in text
    assert "stock 60.0x (60.0x), ours 1.5x (1.5x)" in text
    assert "| ours | 1.02 | 1.02 |" in text
    assert prefill.headlines(results(0.015, 1.02)) == {
        "prefill_ttft_ratio": 1.5,
        "prefill_step_cost": 1.02,
    }


def test_each_target_is_judged() -> None:
    met = [row[3] for row in prefill.summary_rows(results(0.015, 1.02))]
    assert met == [True, None, True]
    missed = [row[3] for row in prefill.summary_rows(results(0.030, 1.5))]
    assert missed == [False, None, False]
