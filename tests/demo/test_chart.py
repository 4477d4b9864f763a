"""The demo's chart from real result objects: every user drawn, the file
written (its numbers are checked where they are computed)."""

from __future__ import annotations

from pathlib import Path

from vllm_output_rate.demo.chart import plot_demo
from vllm_output_rate.demo.engine_view import EngineWatch, Reading
from vllm_output_rate.loadtest import (
    LoadResult,
    LoadSpec,
    RequestRecord,
    UserLoad,
)


def result(limits: dict[str | None, float | None], rate: int) -> LoadResult:
    users = [UserLoad(name, 1, limit) for name, limit in limits.items()]
    spec = LoadSpec(base_url="http://x", model="m", users=users, duration_s=3)
    records = [
        RequestRecord(
            user=u.name,
            stream=0,
            start_s=0.0,
            end_s=3.0,
            first_token_s=0.1,
            chunks=[(0.1 + k / rate, 1) for k in range(3 * rate)],
            finish_reason="length",
            usage_completion_tokens=3 * rate,
            status=200,
        )
        for u in users
    ]
    return LoadResult.build(spec, records, elapsed_s=3.0)


def test_the_chart_is_written_with_every_user(tmp_path: Path) -> None:
    stock = result({"a": None, None: None}, 50)
    limited = result({"a": 20.0, None: 10.0}, 20)
    engine = EngineWatch("http://unused", "key")
    engine.readings = [
        Reading(100.0 + t / 2, {"a": 10 * t, "__anonymous__": 5 * t}) for t in range(7)
    ]
    path = plot_demo(
        stock,
        limited,
        engine,
        100.0,
        {"a": "a", "(anonymous)": "__anonymous__"},
        tmp_path / "demo.png",
    )
    assert path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
