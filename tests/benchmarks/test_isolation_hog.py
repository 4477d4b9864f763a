"""The hog part of the isolation benchmark turns a run into figures (no server)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import isolation_hog
from benchmarks.report import isolation_hog as hog_report
from benchmarks.servers import ISO_A, ISO_A_LIMIT


def counters(admitted: float, reclaimed: float, recomputed: float, vllm: float):
    names = isolation_hog.COUNTERS
    return {
        names["admitted"]: admitted,
        names["reclaimed"]: reclaimed,
        names["recomputed"]: recomputed,
        isolation_hog.VLLM_PREEMPTIONS: vllm,
    }


def test_engine_figures_count_the_hog_in_the_light_users_window(
    tmp_path: Path,
) -> None:
    log = tmp_path / "dispatch.csv"
    start, end = 10 * 10**9, 22 * 10**9  # a 12 s window
    step = 10**9 // int(ISO_A_LIMIT)
    inside = list(range(start, end, step))
    lines = [f"{t},{ISO_A}\n" for t in [start - 5, *inside, end + 1]]
    lines += [f"{start + 1},iso-b\n"]
    log.write_text("".join(lines))
    figures = isolation_hog.hog_figures(
        counters(100, 0, 0, 3), counters(250, 2, 75, 5), [start, end], log
    )
    assert figures["hog_tokens_in_b_window"] == len(inside)
    assert figures["hog_delivered_over_limit"] == len(inside) / (12 * ISO_A_LIMIT)
    assert figures["recomputed_per_hog_token"] == 75 / 150
    assert (figures["reclaimed"], figures["vllm_preemptions"]) == (2, 2)
    stock = isolation_hog.hog_figures(
        counters(0, 0, 0, 0), counters(0, 0, 0, 4), [start, end], None
    )
    assert stock == {"vllm_preemptions": 4}


def test_summary_and_section() -> None:
    def row(server: str, tok_s: float, p95: float, delivered: float | None):
        alone = {"tok_s": 100.0, "ttft_p50_ms": 20.0, "ttft_p95_ms": 40.0}
        b = {"tok_s": tok_s, "ttft_p50_ms": 25.0, "ttft_p95_ms": p95}
        hog = {"b": b, "vllm_preemptions": 1, **isolation_hog.ratios(alone, b)}
        if delivered is not None:
            hog.update(hog_delivered_over_limit=delivered, recomputed_per_hog_token=0.5)
        return {"server": server, "round": 0, "alone": alone, "hog": hog}

    runs = [row("stock", 20.0, 400.0, None), row("ours", 95.0, 60.0, 1.004)]
    summary = isolation_hog.summarize(runs)
    assert summary["ours"]["tok_s_ratio"] == 0.95
    assert summary["ours"]["ttft_p95_ratio"] == 1.5
    assert summary["met"] == {"tok_s": True, "ttft_p95": True, "hog_delivered": True}
    assert summary["stock"]["tok_s_ratio"] == 0.2
    text = "\n".join(
        hog_report.section({"runs": runs, "lead_s": 3.0, "hog_summary": summary})
    )
    assert "4b." in text and "1.004" in text and "**missed**" not in text
    rows = hog_report.summary_rows({"hog_summary": summary})
    assert len(rows) == 1 and rows[0][3] is True
    missed = isolation_hog.summarize([row("ours", 50.0, 200.0, 1.2)])["met"]
    assert missed == {"tok_s": False, "ttft_p95": False, "hog_delivered": False}
