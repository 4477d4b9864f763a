"""The engine-throughput benchmark's step timing (benchmark-only code); its
hook in a fresh interpreter: test_hooks."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import step_timing


def test_read_gives_microseconds_per_step(tmp_path: Path) -> None:
    path = tmp_path / "timing.json"
    assert step_timing.read(str(path)) is None
    path.write_text(
        json.dumps(
            {
                "steps": 4,
                "schedule_ns": 4_000_000,
                "vllm_schedule_ns": 3_000_000,
                "update_ns": 2_000_000,
                "bitmask_ns": 400_000,
                "engine_steps": 5,
                "engine_step_ns": 10_000_000,
            }
        )
    )
    assert step_timing.read(str(path)) == {
        "steps": 4,
        "schedule_us": 1000.0,
        "vllm_schedule_us": 750.0,
        "update_us": 500.0,
        "bitmask_us": 100.0,
        "engine_step_us": 2000.0,
    }
