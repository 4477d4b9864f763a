"""The cache-salt section renders what ``benchmarks.cache_salt.run`` returns,
and judges isolation: no hit with the salt, some without."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import cache_salt

RESULTS = {
    "users": 8,
    "rounds": 10,
    "unsalted": {"hit_share": 0.853, "later_user_latency_s": 0.088, "requests": 80},
    "salted": {"hit_share": 0.0, "later_user_latency_s": 0.141, "requests": 80},
    "latency_salted_over_unsalted": 1.6,
}


def test_the_section_renders_every_figure(tmp_path: Path) -> None:
    text = cache_salt.section(RESULTS, tmp_path, tmp_path)
    assert "| unsalted | 0.853 | 0.088 |" in text
    assert "| salted | 0.000 | 0.141 |" in text
    assert "salted / unsalted: 1.60" in text
    assert cache_salt.headlines(RESULTS) == {"cache_salt_latency": 1.6}


def test_a_hit_with_the_salt_or_none_without_misses() -> None:
    assert cache_salt.summary_rows(RESULTS)[0][3] is True
    for salted, unsalted in ((0.1, 0.853), (0.0, 0.0), (0.0, None)):
        broken = {
            **RESULTS,
            "salted": {**RESULTS["salted"], "hit_share": salted},
            "unsalted": {**RESULTS["unsalted"], "hit_share": unsalted},
        }
        assert cache_salt.summary_rows(broken)[0][3] is False
