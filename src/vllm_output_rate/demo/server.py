"""Start and stop a real vLLM OpenAI API server for end-to-end tests.

Usage::

    with running_server(model_path, ["--max-num-seqs", "8"]) as base_url:
        ...  # base_url == "http://127.0.0.1:PORT"; base_url.log_text() etc.

The server runs in its own process group (its own session), so on exit the
whole group, engine-core and worker processes included, gets SIGTERM and,
if anything is still alive after ``stop_timeout_s``, SIGKILL.  Its output goes
to a log file in a fresh temporary folder (kept afterwards, for post-mortems);
a failed start raises ServerStartError with the last lines of that log.

Defaults suit this project's 2-core CPU machines: ``DEFAULT_ARGS`` come
before ``extra_args`` (argparse keeps the last value, so callers can override
them) and ``DEFAULT_ENV`` goes under ``env``.  Pass ``env={"VLLM_PLUGINS": ""}``
to keep the project's plugin out of a stock server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

DEFAULT_ARGS: tuple[str, ...] = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "1024",
)
DEFAULT_ENV: dict[str, str] = {"VLLM_CPU_KVCACHE_SPACE": "1"}
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
LOG_TAIL_LINES = 50
# The free port we pick can be taken by someone else before vLLM binds it.
PORT_ATTEMPTS = 3


class ServerStartError(RuntimeError):
    """The server did not become healthy; the message ends with its log."""


class RunningServer(str):
    """The server's base URL (``http://127.0.0.1:PORT``), a plain ``str``,
    with a few extras for tests that need them."""

    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    def __new__(
        cls, url: str, port: int, log_path: Path, process: subprocess.Popen[bytes]
    ) -> RunningServer:
        obj = super().__new__(cls, url)
        obj.port = port
        obj.log_path = log_path
        obj.process = process
        return obj

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        # Copies and pickles (dataclasses.asdict deep-copies) are plain strs.
        return (str, (str(self),))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(could not read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """preexec_fn: have Linux SIGTERM the server if the test process dies
    without cleaning up (e.g. SIGKILL); vLLM then stops its engine processes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_process_group(
    process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S
) -> None:
    """SIGTERM the process group led by ``process``; SIGKILL whatever is
    left after ``timeout_s``; reap the leader.  Safe to call twice."""
    pgid = process.pid  # start_new_session=True: the leader's pid is the pgid
    if process.returncode is not None and not _group_alive(pgid):
        return  # already stopped and reaped: the pid may belong to others now
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    # The leader may be gone while engine processes linger: wait for the group.
    # process.poll() reaps the leader: a zombie would still count as alive.
    while process.poll() is None or _group_alive(pgid):
        if time.monotonic() >= deadline:
            _signal_group(pgid, signal.SIGKILL)
            break
        time.sleep(0.1)
    kill_deadline = time.monotonic() + 10.0
    while (process.poll() is None or _group_alive(pgid)) and (
        time.monotonic() < kill_deadline
    ):
        time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10.0)


def _wait_healthy(
    url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if _healthy(url):
            return
        code = process.poll()
        if code is not None:
            raise ServerStartError(
                f"vLLM server exited with code {code} before becoming healthy "
                f"(log: {log_path}); last {LOG_TAIL_LINES} lines:\n"
                + log_tail(log_path)
            )
        if time.monotonic() >= deadline:
            raise ServerStartError(
                f"vLLM server at {url} not healthy after {timeout_s:g} s "
                f"(log: {log_path}); last {LOG_TAIL_LINES} lines:\n"
                + log_tail(log_path)
            )
        time.sleep(0.5)


def server_command(
    model_path: str | os.PathLike[str], port: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *DEFAULT_ARGS,
        *extra_args,
    ]


@contextlib.contextmanager
def running_server(
    model_path: str | os.PathLike[str],
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    start_timeout_s: float = START_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    log_dir: str | os.PathLike[str] | None = None,
) -> Iterator[RunningServer]:
    """Run ``python -m vllm.entrypoints.openai.api_server`` on a free port of
    127.0.0.1 and yield its base URL once ``/health`` answers 200.

    ``env`` is layered over ``os.environ`` and ``DEFAULT_ENV``.  The log is
    ``server.log`` in ``log_dir`` (default: a new temporary folder).
    """
    full_env = {**os.environ, **DEFAULT_ENV, **(env or {})}
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vllm-server-"))
    folder.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = folder / (
            "server.log" if attempt == 1 else f"server.attempt{attempt}.log"
        )
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                server_command(model_path, port, extra_args),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        try:
            try:
                _wait_healthy(url, process, log_path, start_timeout_s)
            except ServerStartError:
                in_use = "address already in use" in log_tail(log_path, 200).lower()
                if in_use and attempt < PORT_ATTEMPTS:
                    continue  # the finally below stops this attempt's group
                raise
            yield RunningServer(url, port, log_path, process)
            return
        finally:
            stop_process_group(process, stop_timeout_s)
