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
        "hog_prompt_tokens_per_s": 40_000.0,
    }


def results(ours_beside_s: float, cost: float, paced: float | None = None) -> dict:
    """A run; ``paced``: the latency ratio with the hog's prompts paced (None:
    a run from before that server was measured)."""
    servers = {"stock": server(0.010, 0.600), "ours": server(0.010, ours_beside_s)}
    if paced is not None:
        servers[prefill.PROMPT_RATE] = {
            **server(0.010, 0.012),
            "latency_p50_ratio": paced,
            "hog_prompt_tokens_per_s": 3_010.0,
        }
    return {
        "hog_streams": 16,
        "light_requests": 40,
        "servers": servers,
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
    met = [row[3] for row in prefill.summary_rows(results(0.015, 1.02, paced=1.4))]
    assert met == [True, None, True, True]
    met = [row[3] for row in prefill.summary_rows(results(0.015, 1.02, paced=2.5))]
    assert met == [True, None, False, True]


def test_the_prompt_rate_server_has_a_row_of_its_own(tmp_path: Path) -> None:
    text = prefill.section(results(0.015, 1.02, paced=1.4), tmp_path, tmp_path)
    assert f"| {prefill.PROMPT_RATE} | 10 | 12 | 20 | 24 |" in text
    assert "| 30.0 | 3,010 |" in text
    assert f"{prefill.PROMPT_RATE} 1.4x" in text
    missed = [row[3] for row in prefill.summary_rows(results(0.030, 1.5))]
    assert missed == [False, None, False]
