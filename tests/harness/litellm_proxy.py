"""A real LiteLLM proxy for tests, from its PyPI package, in a virtual
environment of its own.

``litellm_command()`` is the ``litellm`` command of ``.cache/litellm-proxy``,
which it creates with ``litellm[proxy]`` (pinned) on first use, with uv
(seconds; pip's resolver took a minute of the suite); its many dependencies
never meet vLLM's.
``VLLM_OUTPUT_RATE_LITELLM`` names an installed command instead. When the
package cannot be installed (no network), the test is skipped, except in CI
(``CI`` set, as ``.ci/run`` has it), where it fails.

``running_litellm(config)`` starts the proxy with that config (a dict
written as YAML; no database) on a free port of 127.0.0.1, and yields its
URL once it answers; on exit it is stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from uv import find_uv_bin

from vllm_output_rate.demo.server import free_port, log_tail, stop_process_group

# 1.108.x is the newest line whose proxy extra installs from PyPI alone
# (1.109+ pins packages that PyPI did not serve when this was written).
REQUIREMENT = "litellm[proxy]==1.108.7"
ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".cache" / "litellm-proxy"
COMMAND_ENV = "VLLM_OUTPUT_RATE_LITELLM"
INSTALL_TIMEOUT_S = 1200.0
START_TIMEOUT_S = 180.0
# No remote model-price map, no telemetry: the proxy runs offline.
PROXY_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}


def litellm_command() -> str:
    given = os.environ.get(COMMAND_ENV)
    if given:
        return given
    stamp = VENV / f".installed-{REQUIREMENT}"
    command = VENV / "bin" / "litellm"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    # One installer at a time (test processes may start together).
    with open(VENV.parent / "litellm-proxy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            _install(stamp)
    return str(command)


def _install(stamp: Path) -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    uv = find_uv_bin()
    steps = [
        [uv, "venv", "--quiet", "--python", sys.executable, str(VENV)],
        [uv, "pip", "install", "--quiet", "--python", str(VENV / "bin" / "python"),
         REQUIREMENT],
    ]  # fmt: skip
    for step in steps:
        try:
            done = subprocess.run(
                step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            _unavailable(f"`{' '.join(step)}` took over {INSTALL_TIMEOUT_S:.0f} s")
        if done.returncode != 0:
            _unavailable(f"`{' '.join(step)}` failed:\n{done.stderr[-3000:]}")
    stamp.touch()


def _unavailable(why: str) -> None:
    message = f"cannot install the LiteLLM proxy ({REQUIREMENT}): {why}"
    shutil.rmtree(VENV, ignore_errors=True)
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def running_litellm(config: dict[str, Any]) -> Iterator[str]:
    command = litellm_command()
    folder = Path(tempfile.mkdtemp(prefix="litellm-"))
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = folder / "litellm.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [command, "--config", str(config_path), "--host", "127.0.0.1",
             "--port", str(port), "--num_workers", "1"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **PROXY_ENV},
            cwd=folder,
            start_new_session=True,
        )  # fmt: skip
    try:
        _wait_ready(url, process, log_path)
        yield url
    finally:
        stop_process_group(process, 20.0)


def _wait_ready(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health/liveliness", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"the LiteLLM proxy did not start at {url}:\n{log_tail(log_path, 60)}"
    )
