"""The benchmark-only sitecustomize hooks, in fresh interpreters started the
way a server's processes are: from another folder, with only the hook's
PYTHONPATH to find ``benchmarks.*``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import hooks, step_timing


def run_python(
    tmp_path: Path, python_path: str, env: dict[str, str], code: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter outside the checkout."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": python_path, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_hook_installs_from_anywhere_and_keeps_the_seam_checks_true(
    tmp_path: Path,
) -> None:
    # A fresh interpreter, started outside the checkout the way an engine's
    # processes are, finds benchmarks.step_timing through the hook's
    # PYTHONPATH alone; the wrappers it installs process-wide must not hide
    # what the plugin's start-up checks read (the 'ours' engine would refuse
    # to start).
    path = hooks.install(tmp_path / "hook", step_timing.HOOK)
    done = run_python(
        tmp_path,
        path,
        {step_timing.PATH_ENV: str(tmp_path / "timing.json")},
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "from vllm_output_rate.seams_check import verify_seams\n"
        "assert Scheduler.schedule.__wrapped__\n"
        "verify_seams(api=False)\n",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = tmp_path / "engine.log"
    log.write_text(done.stderr)
    assert hooks.check_log(log, step_timing.HOOK_NAME) == 1


def test_a_failing_hook_never_breaks_start_up_but_fails_the_check(
    tmp_path: Path,
) -> None:
    source = hooks.hook_source("broken", "BENCH_TEST_BROKEN", "import no_such_module")
    path = hooks.install(tmp_path / "hook", source)
    done = run_python(tmp_path, path, {"BENCH_TEST_BROKEN": "1"}, "print('alive')")
    assert done.returncode == 0 and done.stdout.strip() == "alive"
    log = tmp_path / "run.log"
    # vLLM prefixes its child processes' lines; the check must still see them.
    log.write_text(
        "".join(f"(EngineCore pid=1) {line}\n" for line in done.stderr.splitlines())
    )
    with pytest.raises(RuntimeError, match=r"broken NOT installed.*no_such_module"):
        hooks.check_log(log, "broken")


def test_check_log_of_a_missing_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot read"):
        hooks.check_log(tmp_path / "absent.log", "step-timing")
