"""What the server benchmarks measure besides the load generator's own
figures: CPU seconds of a server's processes and of the rest of the machine,
a gate that waits for a quiet machine before each measurement, whether a
server has drained, and client-side token counts from a load's records."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx

from vllm_output_rate.demo.server import RunningServer
from vllm_output_rate.loadtest import LoadResult

# ----- process CPU -----------------------------------------------------------


def server_processes(url: RunningServer) -> dict[str, Any]:
    """role -> psutil.Process for a server's process tree.

    Roles: ``api_server`` (the group leader), ``engine_core`` (process title
    ``VLLM::EngineCore``: scheduler and engine loop), ``worker``
    (``VLLM::Worker...``: runs the model), ``other`` (helpers)."""
    import psutil

    leader = psutil.Process(url.process.pid)
    roles: dict[str, Any] = {"api_server": leader}
    for child in leader.children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "EngineCore" in title:
            roles["engine_core"] = child
        elif "Worker" in title:
            roles.setdefault("worker", child)
        else:
            roles.setdefault("other", child)
    if "engine_core" not in roles:
        raise RuntimeError(f"no EngineCore process found under pid {leader.pid}")
    return roles


def cpu_seconds(processes: dict[str, Any]) -> dict[str, float]:
    """role -> user + system CPU seconds so far."""
    out = {}
    for role, proc in processes.items():
        times = proc.cpu_times()
        out[role] = times.user + times.system
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


class OthersCpu:
    """CPU used by everything on the machine except this process and its
    descendants (the servers), over a ``with`` block: ``cores`` afterwards
    is the average number of cores the rest of the machine kept busy."""

    BUSY = ("user", "nice", "system", "irq", "softirq")

    def __enter__(self) -> OthersCpu:
        self._t0 = time.monotonic()
        self._sys0 = self._system()
        self._own0 = self._own()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self._t0
        own = self._own()
        own_delta = sum(v - self._own0.get(pid, 0.0) for pid, v in own.items())
        others = (self._system() - self._sys0) - own_delta
        self.cores = max(0.0, others) / elapsed if elapsed > 0 else None

    def _system(self) -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in self.BUSY)

    @staticmethod
    def _own() -> dict[int, float]:
        import psutil

        me = psutil.Process()
        out = {}
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                out[proc.pid] = times.user + times.system
        return out


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def wait_until_drained(url: str, timeout_s: float = 30.0) -> bool:
    """Wait until the server has no running or waiting request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            busy = _metric(url, "vllm:num_requests_running") + _metric(
                url, "vllm:num_requests_waiting"
            )
            if busy == 0:
                return True
        time.sleep(0.5)
    return False


# ----- a quiet machine ---------------------------------------------------------


QUIET_CORES = 0.3  # "quiet": the rest of the machine uses less than this
QUIET_MAX_WAIT_S = 15.0  # per measurement
QUIET_BUDGET_S = {True: 20.0, False: 150.0}  # per run (quick, full)


class QuietGate:
    """Before a measurement, wait until the rest of the machine is quiet
    (other processes below QUIET_CORES cores over a 1 s sample), at most
    QUIET_MAX_WAIT_S each time and ``budget_s`` in all, then go on anyway.
    The samples double as the pause that lets vLLM's worker stop spinning
    after the previous run (it busy-polls for 1 s after each message)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.waits = 0
        self.gave_up = 0
        self.last_cores: float | None = None

    def wait(self) -> float:
        time.sleep(0.5)
        waited = 0.0
        while True:
            with OthersCpu() as others:
                time.sleep(1.0)
            waited += 1.0
            self.last_cores = others.cores
            if others.cores is not None and others.cores < QUIET_CORES:
                break
            if waited >= QUIET_MAX_WAIT_S or self.spent_s + waited >= self.budget_s:
                self.gave_up += 1
                break
        self.waits += 1
        self.spent_s += waited - 1.0  # the first second is the settle pause
        return waited

    def summary(self) -> dict[str, Any]:
        return {
            "threshold_cores": QUIET_CORES,
            "budget_s": self.budget_s,
            "extra_wait_s": self.spent_s,
            "waits": self.waits,
            "gave_up": self.gave_up,
        }


# ----- small helpers ---------------------------------------------------------


def tokens_between(result: LoadResult, user: str | None, lo: float, hi: float) -> int:
    return sum(
        n
        for r in result.records
        if r.user == user
        for t, n in r.chunks
        if lo <= t <= hi
    )
