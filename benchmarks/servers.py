"""The vLLM OpenAI servers the isolation and accuracy benchmarks share: the
flags every server runs with, the named limits of ours, and a pool that
starts them (in parallel), keeps them running and stops them.

* ``stock``: no limit flags (the plugin leaves vLLM's scheduler alone);
* ``ours``: every user at ``FAR_LIMIT`` except the benchmarks' named users,
  the scheduler's dispatch log, and the plugin's HTTP part (its counters on
  ``/metrics``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from benchmarks.kinds import FAR_LIMIT
from benchmarks.measure import log
from benchmarks.noise import QUIET_BUDGET_S, QuietGate
from vllm_output_rate.demo.server import (
    DEFAULT_ARGS,
    DEFAULT_ENV,
    RunningServer,
    running_server,
)
from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV

# The same flags for stock and ours; --max-model-len 4096 (the tiny model's
# maximum) lets rate-accuracy requests outlast a 20 s run at 100 tok/s.
SERVER_ARGS: list[str] = ["--max-num-seqs", "64", "--max-model-len", "4096"]
START_TIMEOUT_S = 600.0  # a loaded 2-core machine has taken 135 s to start one

ISO_A, ISO_A_LIMIT, ISO_A_STREAMS = "iso-a", 10.0, 32
ISO_B, ISO_B_LIMIT = "iso-b", 10_000.0
ACC_LIMITS: tuple[float, ...] = (5, 20, 100, 500)
ACC_STREAMS: tuple[int, ...] = (1, 4, 16)
QUICK_ACC_STREAMS: tuple[int, ...] = (1, 16)


def common_flags() -> dict[str, object]:
    """The engine flags and environment every benchmark server runs with
    (the demo server's defaults, then SERVER_ARGS; a later flag wins, as in
    vLLM's parser): flag -> value (True for a switch), for the report."""
    flags: dict[str, object] = {}
    args = [*DEFAULT_ARGS, *SERVER_ARGS]
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) else None
            flags[arg] = True if value is None or value.startswith("--") else value
    return {"flags": flags, "env": dict(DEFAULT_ENV)}


def acc_user(limit: float, streams: int) -> str:
    return f"acc-{limit:g}x{streams}"


def ours_user_limits() -> dict[str, float]:
    """Named limits of the ``ours`` server (everyone else: FAR_LIMIT)."""
    limits = {ISO_A: ISO_A_LIMIT, ISO_B: ISO_B_LIMIT}
    for limit in ACC_LIMITS:
        for streams in ACC_STREAMS:
            limits[acc_user(limit, streams)] = float(limit)
    return limits


class _ServerThread(threading.Thread):
    """Owns one server for its whole life: ``running_server`` arms
    PR_SET_PDEATHSIG, which fires when the *thread* that forked the server
    exits, so the thread that starts it stays alive until it stops."""

    def __init__(
        self, model: str, args: list[str], env: dict[str, str], log_dir: Path
    ) -> None:
        super().__init__(name=f"server-{log_dir.name}", daemon=False)
        self.model, self.args, self.env, self.log_dir = model, args, env, log_dir
        self.ready = threading.Event()
        self.stop_event = threading.Event()
        self.url: RunningServer | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with running_server(
                self.model,
                self.args,
                env=self.env,
                start_timeout_s=START_TIMEOUT_S,
                log_dir=self.log_dir,
            ) as url:
                self.url = url
                self.ready.set()
                self.stop_event.wait()
        except BaseException as exc:  # reported by the pool
            self.error = exc
        finally:
            self.ready.set()


class ServerPool:
    """``stock`` and ``ours`` (module docstring), started on demand."""

    def __init__(self, model: str, work_dir: Path, quick: bool = False) -> None:
        self.model = model
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.dispatch_log_path = self.work_dir / "dispatch.csv"
        limits = [
            "--default-user-output-tokens-per-second",
            f"{FAR_LIMIT:g}",
            "--user-output-tokens-per-second",
            json.dumps(ours_user_limits()),
        ]
        self.configs: dict[str, tuple[list[str], dict[str, str]]] = {
            "stock": (list(SERVER_ARGS), {}),
            "ours": (
                [*SERVER_ARGS, *limits],
                {
                    DISPATCH_LOG_ENV: str(self.dispatch_log_path),
                    "VLLM_PLUGINS": "output_rate,output_rate_http",
                },
            ),
        }
        self.gate = QuietGate(QUIET_BUDGET_S[quick])
        self._threads: dict[str, _ServerThread] = {}

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        for name in list(self._threads):
            self.stop(name)

    def start(self, *names: str) -> None:
        """Start the named servers that are not running, in parallel."""
        new = [n for n in names if n not in self._threads]
        for name in new:
            if name == "ours":
                self.dispatch_log_path.unlink(missing_ok=True)  # the log appends
            args, env = self.configs[name]
            thread = _ServerThread(self.model, args, env, self.work_dir / name)
            self._threads[name] = thread
            thread.start()
        started = time.monotonic()
        for name in new:
            thread = self._threads[name]
            thread.ready.wait()
            if thread.error is not None:
                self.stop(name)
                raise RuntimeError(f"server {name!r} did not start: {thread.error}")
            log(f"server {name} up after {time.monotonic() - started:.0f} s")

    def settle(self) -> float:
        """Pause before a measurement (see QuietGate); returns seconds."""
        return self.gate.wait()

    def url(self, name: str) -> RunningServer:
        self.start(name)
        url = self._threads[name].url
        assert url is not None
        return url

    def stop(self, name: str) -> None:
        thread = self._threads.pop(name, None)
        if thread is not None:
            thread.stop_event.set()
            thread.join()
