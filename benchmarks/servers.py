"""The vLLM servers the server-level benchmarks run against: flags and named
limits shared by every server (stock, ours, ours without the idle wait), and
a pool that starts them on demand, in parallel, and keeps them running."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import hooks
from benchmarks.hooks import hook_source
from benchmarks.noise import QUIET_BUDGET_S, QuietGate
from benchmarks.progress import log
from vllm_output_rate.demo.server import (
    DEFAULT_ARGS,
    DEFAULT_ENV,
    RunningServer,
    running_server,
)
from vllm_output_rate.scheduling.dispatch_log import ENV as DISPATCH_LOG_ENV

# ----- configuration shared by every server ----------------------------------

# Same flags for stock and ours; only the limit flags differ.
# --max-model-len 4096 (the tiny model's maximum) lets rate-accuracy
# requests outlast a 20 s run at 100 tok/s.
SERVER_ARGS: list[str] = ["--max-num-seqs", "64", "--max-model-len", "4096"]
START_TIMEOUT_S = 600.0  # a loaded 2-core machine has taken 135 s to start one
DEFAULT_LIMIT = 1e6  # "far above demand": every user not listed below

THROUGHPUT_USER = "tp"  # default limit (1e6 tok/s)
IDLE_USER, IDLE_LIMIT, IDLE_STREAMS = "idle-a", 1.0, 8
ISO_A, ISO_A_LIMIT, ISO_A_STREAMS = "iso-a", 10.0, 32
ISO_B, ISO_B_LIMIT = "iso-b", 10_000.0
ACC_LIMITS: tuple[float, ...] = (5, 20, 100, 500)
ACC_STREAMS: tuple[int, ...] = (1, 4, 16)
QUICK_ACC_STREAMS: tuple[int, ...] = (1, 16)

NO_IDLE_WAIT_ENV = "VLLM_OUTPUT_RATE_BENCH_NO_IDLE_WAIT"
NO_IDLE_WAIT_HOOK_NAME = "no-idle-wait"
# Benchmark-only hook (benchmarks.hooks) on one server's PYTHONPATH: every
# process of that server (the engine core included) imports it at start. It
# replaces the plugin's idle wait by a no-op, which leaves vLLM's own loop: a
# step that runs no model work is followed by time.sleep(0.001) while
# requests exist. The package itself has no switch for this; this is only a
# counterfactual. It fails (and the pool refuses the server) if the plugin's
# engine loop no longer has the function it replaces.
NO_IDLE_WAIT_HOOK = hook_source(
    NO_IDLE_WAIT_HOOK_NAME,
    NO_IDLE_WAIT_ENV,
    """
    from vllm_output_rate.integration import engine_loop

    if not callable(getattr(engine_loop, "wait_for_budget", None)):
        raise AttributeError("engine_loop.wait_for_budget is gone")
    engine_loop.wait_for_budget = lambda engine_core: None
    """,
)


def common_flags() -> dict[str, object]:
    """The engine flags and environment every benchmark server runs with
    (the demo server's defaults under SERVER_ARGS; a later flag wins, as in
    vLLM's argument parser), for the report: flag -> value (True for a
    switch)."""
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
    """Named limits of the 'ours' servers (everyone else: DEFAULT_LIMIT)."""
    limits = {IDLE_USER: IDLE_LIMIT, ISO_A: ISO_A_LIMIT, ISO_B: ISO_B_LIMIT}
    for limit in ACC_LIMITS:
        for streams in ACC_STREAMS:
            limits[acc_user(limit, streams)] = float(limit)
    return limits


def ours_limit_flags() -> list[str]:
    return [
        "--default-user-output-tokens-per-second",
        f"{DEFAULT_LIMIT:g}",
        "--user-output-tokens-per-second",
        json.dumps(ours_user_limits()),
    ]


# ----- servers -----------------------------------------------------------------


@dataclass
class ServerConfig:
    name: str
    description: str
    args: list[str]
    env: dict[str, str]
    hook: str | None = None  # a benchmarks.hooks hook that must have run


class _ServerThread(threading.Thread):
    """Owns one server for its whole life.

    The server is started from this thread and stopped from it, and the
    thread stays alive in between: ``running_server`` arms PR_SET_PDEATHSIG,
    which fires when the *thread* that forked the server exits.
    """

    def __init__(self, model: str, config: ServerConfig, log_dir: Path) -> None:
        super().__init__(name=f"server-{config.name}", daemon=False)
        self.model = model
        self.config = config
        self.log_dir = log_dir
        self.ready = threading.Event()
        self.stop_event = threading.Event()
        self.url: RunningServer | None = None
        self.error: BaseException | None = None
        self.start_s = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            with running_server(
                self.model,
                self.config.args,
                env=self.config.env,
                start_timeout_s=START_TIMEOUT_S,
                log_dir=self.log_dir,
            ) as url:
                self.start_s = time.monotonic() - started
                self.url = url
                self.ready.set()
                self.stop_event.wait()
        except BaseException as exc:  # reported by the pool
            self.error = exc
        finally:
            self.ready.set()


class ServerPool:
    """Named server configurations, started on demand (several at once, in
    parallel, with ``start``) and kept running until ``stop`` or ``close``.

    * ``stock``: no limit flags (the plugin leaves vLLM's scheduler alone);
    * ``ours``: limits (DEFAULT_LIMIT for everyone, named users from
      ``ours_user_limits``), the scheduler's dispatch log and the plugin's
      HTTP part (its counters on ``/metrics``);
    * ``ours-nowait``: the same limits with the plugin's idle wait switched
      off by NO_IDLE_WAIT_HOOK (no dispatch log).
    """

    def __init__(self, model: str, work_dir: Path, quick: bool = False) -> None:
        self.model = model
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.dispatch_log_path = self.work_dir / "dispatch.csv"
        python_path = hooks.install(
            self.work_dir / "no-idle-wait-hook", NO_IDLE_WAIT_HOOK
        )
        self.configs: dict[str, ServerConfig] = {
            "stock": ServerConfig(
                "stock", "stock vLLM (no limit flags)", list(SERVER_ARGS), {}
            ),
            "ours": ServerConfig(
                "ours",
                "with limits (default 1e6 tok/s, named users limited), dispatch "
                "log, the plugin's metrics on /metrics",
                [*SERVER_ARGS, *ours_limit_flags()],
                {
                    DISPATCH_LOG_ENV: str(self.dispatch_log_path),
                    "VLLM_PLUGINS": "output_rate,output_rate_http",
                },
            ),
            "ours-nowait": ServerConfig(
                "ours-nowait",
                "with limits, idle wait switched off (vLLM's 1 ms loop)",
                [*SERVER_ARGS, *ours_limit_flags()],
                {"PYTHONPATH": python_path, NO_IDLE_WAIT_ENV: "1"},
                hook=NO_IDLE_WAIT_HOOK_NAME,
            ),
        }
        self.gate = QuietGate(QUIET_BUDGET_S[quick])
        self._threads: dict[str, _ServerThread] = {}
        self.start_times_s: dict[str, float] = {}
        self.logs: dict[str, Path] = {}

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, *names: str) -> None:
        """Start the named servers that are not running, in parallel."""
        new = [n for n in names if n not in self._threads]
        for name in new:
            if name == "ours" and self.dispatch_log_path.exists():
                self.dispatch_log_path.unlink()  # the log appends
            log_dir = self.work_dir / f"server-{name}"
            thread = _ServerThread(self.model, self.configs[name], log_dir)
            self._threads[name] = thread
            self.logs[name] = log_dir / "server.log"
            thread.start()
        if new:
            log(f"starting server(s): {', '.join(new)}")
        for name in new:
            thread = self._threads[name]
            thread.ready.wait()
            if thread.error is not None:
                self.stop(name)
                raise RuntimeError(
                    f"server {name!r} did not start: {thread.error}"
                ) from thread.error
            hook = self.configs[name].hook
            if hook is not None:
                try:
                    hooks.check_log(self.logs[name], hook)
                except RuntimeError:
                    self.stop(name)
                    raise
            self.start_times_s[name] = thread.start_s
            log(f"server {name} up at {thread.url} after {thread.start_s:.0f} s")

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
        if thread is None:
            return
        thread.stop_event.set()
        thread.join()
        log(f"server {name} stopped")

    def close(self) -> None:
        names = list(self._threads)
        for name in names:
            self._threads[name].stop_event.set()
        for name in names:
            self.stop(name)
