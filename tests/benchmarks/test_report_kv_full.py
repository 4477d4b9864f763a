"""The KV-full section renders what ``benchmarks.kv_full.run`` returns, and
judges ours by its worst U: at least stock's tokens sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import kv_full


def results(u10k_sampled: int) -> dict[str, Any]:
    subjects = {
        "stock": {"scheduled_per_step": 450.9, "least_per_step": 383,
                  "sampled": 157_731, "computed": 164_650, "preemptions": 129},
        "U=256": {"scheduled_per_step": 486.3, "least_per_step": 391,
                  "sampled": 161_016, "computed": 170_605,
                  "preemptions": 369},
        "U=10,000": {"scheduled_per_step": 512.0, "least_per_step": 512,
                     "sampled": u10k_sampled, "computed": 176_141,
                     "preemptions": 474},
    }  # fmt: skip
    for figures in subjects.values():
        figures["sampled_over_stock"] = figures["sampled"] / 157_731
    return {
        "requests": 1024,
        "active": 512,
        "blocks_per_request": 8,
        "steps": 320,
        "judged_steps": 100,
        "subjects": subjects,
    }


def test_the_section_renders_every_figure(tmp_path: Path) -> None:
    text = kv_full.section(results(163_840), tmp_path, tmp_path)
    assert "1,024 resident requests, 512 active slots" in text
    assert "| stock | 450.9 | 383 | 157,731 | 1.000 | 164,650 | 129 |" in text
    assert "| U=10,000 | 512.0 | 512 | 163,840 | 1.039 | 176,141 | 474 |" in text
    assert kv_full.headlines(results(163_840)) == {"kv_full_sampled": 161_016 / 157_731}


def test_ours_below_stock_at_any_u_misses() -> None:
    ((what, target, measured, met),) = kv_full.summary_rows(results(163_840))
    assert what.startswith("KV cache full")
    assert met is True and target == ">= 1.0"
    assert measured == "1.021 (U=256) / 1.039 (U=10,000)"
    ((*_, met),) = kv_full.summary_rows(results(142_665))  # before the fix
    assert met is False
