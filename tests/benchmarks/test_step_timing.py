"""The engine-throughput benchmark's timing hook (benchmark-only code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import step_timing


def test_the_hook_keeps_the_plugins_seam_checks_true(tmp_path: Path) -> None:
    # Installed in a fresh interpreter: it wraps vLLM classes process-wide.
    # The 'ours' engine refuses to start if a wrapper hid what the plugin's
    # start-up checks read (signatures, source).
    code = (
        "from benchmarks import step_timing\n"
        f"step_timing.install({str(tmp_path / 'timing.json')!r})\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "from vllm_output_rate.seams import verify_seams\n"
        "assert Scheduler.schedule.__wrapped__\n"
        "verify_seams(api=False)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


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
        "engine_step_us": 2000.0,
    }
