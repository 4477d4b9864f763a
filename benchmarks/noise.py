"""How busy the rest of the machine is: the noise beside every figure.

The machines this runs on are shared, so the CPU that everything else used
is counted: system busy time minus the CPU of this process and all its
descendants (the servers and engines).

* ``OthersCpu``: that count over one ``with`` block;
* ``NoiseMonitor``: the same, sampled once a second in a thread, per named
  period (one section of the report);
* ``QuietGate``: before a measurement, wait (within a budget) until the rest
  of the machine is quiet.
"""

from __future__ import annotations

import contextlib
import threading
import time

import psutil

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")
QUIET_CORES = 0.3  # "quiet": the rest of the machine uses less than this
QUIET_MAX_WAIT_S = 15.0  # per measurement
QUIET_BUDGET_S = {True: 20.0, False: 150.0}  # per run (quick, full)


def tree_cpu(pid: int | None = None) -> dict[int, float]:
    """pid -> user + system CPU seconds of a process (default: this one) and
    its descendants; empty if it is gone."""
    out: dict[int, float] = {}
    try:
        leader = psutil.Process(pid)
        tree = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[proc.pid] = times.user + times.system
    return out


class _Sample:
    """The machine's busy CPU seconds and ours, at one moment."""

    def __init__(self) -> None:
        cpu = psutil.cpu_times()
        self.at = time.monotonic()
        self.busy = sum(getattr(cpu, f, 0.0) for f in BUSY_FIELDS)
        self.own = tree_cpu()

    def others_cores(self, before: _Sample) -> float | None:
        """Cores the rest of the machine used since ``before`` (a process
        born in between counts from zero)."""
        elapsed = self.at - before.at
        if elapsed <= 0:
            return None
        own = sum(v - before.own.get(pid, 0.0) for pid, v in self.own.items())
        # The counters are read moments apart: keep within 0 and every core.
        others = max(0.0, self.busy - before.busy - own) / elapsed
        return min(others, float(psutil.cpu_count() or 1))


class OthersCpu:
    """``cores`` after the ``with`` block: the average number of cores the
    rest of the machine kept busy during it."""

    def __enter__(self) -> OthersCpu:
        self._before = _Sample()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.cores = _Sample().others_cores(self._before)


class NoiseMonitor(threading.Thread):
    """Samples the rest of the machine once a second; ``mark(label)`` starts
    a period, ``summary(label)`` is its average (None if it had no sample)."""

    def __init__(self) -> None:
        super().__init__(name="noise-monitor", daemon=True)
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._label: str | None = None
        self._last = _Sample()
        self._periods: dict[str, list[float]] = {}  # label -> [seconds, cpu s]

    def _sample(self) -> None:
        now = _Sample()
        cores = now.others_cores(self._last)
        with self._lock:
            if self._label is not None and cores is not None:
                period = self._periods.setdefault(self._label, [0.0, 0.0])
                period[0] += now.at - self._last.at
                period[1] += cores * (now.at - self._last.at)
        self._last = now

    def run(self) -> None:
        while not self._stop_event.wait(1.0):
            with contextlib.suppress(Exception):
                self._sample()

    def mark(self, label: str | None) -> None:
        with contextlib.suppress(Exception):
            self._sample()
        with self._lock:
            self._label = label

    def stop(self) -> None:
        self.mark(None)
        self._stop_event.set()

    def summary(self, label: str) -> dict[str, float] | None:
        with self._lock:
            seconds, cpu_s = self._periods.get(label, (0.0, 0.0))
        if seconds <= 0:
            return None
        return {"seconds": seconds, "others_cores": cpu_s / seconds}


class QuietGate:
    """Wait until the rest of the machine uses under QUIET_CORES cores over a
    1 s sample, at most QUIET_MAX_WAIT_S each time and ``budget_s`` in all,
    then go on anyway. The samples double as the pause that lets vLLM's
    worker stop spinning after the previous run (it polls for 1 s)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.spent_s = 0.0

    def wait(self) -> float:
        time.sleep(0.5)
        waited = 0.0
        while True:
            with OthersCpu() as others:
                time.sleep(1.0)
            waited += 1.0
            if others.cores is not None and others.cores < QUIET_CORES:
                break
            if waited >= QUIET_MAX_WAIT_S or self.spent_s + waited >= self.budget_s:
                break
        self.spent_s += waited - 1.0  # the first second is the settle pause
        return waited
