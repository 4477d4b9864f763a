"""How busy the rest of the machine is: the noise beside every figure.

The machines this runs on are shared, so every measurement is taken beside a
count of the CPU that everything else used meanwhile: system busy time minus
the CPU of this process and all its descendants (the servers and engines).

* ``OthersCpu``: that count over one ``with`` block (one measurement);
* ``NoiseMonitor``: the same, sampled once a second in a thread, per named
  period (one benchmark) for the report's noise line;
* ``QuietGate``: before a measurement, wait (within a budget) until the rest
  of the machine is quiet.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psutil

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")

QUIET_CORES = 0.3  # "quiet": the rest of the machine uses less than this
QUIET_MAX_WAIT_S = 15.0  # per measurement
QUIET_BUDGET_S = {True: 20.0, False: 150.0}  # per run (quick, full)


def system_cpu() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine since boot."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in BUSY_FIELDS), getattr(t, "steal", 0.0)


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


def own_cpu() -> dict[int, float]:
    """pid -> CPU seconds of this process and its descendants (the servers)."""
    return tree_cpu()


def others_cpu_s(
    busy_delta_s: float, own_before: dict[int, float], own_after: dict[int, float]
) -> float:
    """CPU seconds the rest of the machine used: the machine's busy time over
    a period minus what our processes used in it (a process born in the
    period counts from zero)."""
    own_delta = sum(v - own_before.get(pid, 0.0) for pid, v in own_after.items())
    return max(0.0, busy_delta_s - own_delta)


class OthersCpu:
    """CPU used by everything on the machine except this process and its
    descendants, over a ``with`` block: ``cores`` afterwards is the average
    number of cores the rest of the machine kept busy."""

    def __enter__(self) -> OthersCpu:
        self._t0 = time.monotonic()
        self._busy0 = system_cpu()[0]
        self._own0 = own_cpu()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self._t0
        others = others_cpu_s(system_cpu()[0] - self._busy0, self._own0, own_cpu())
        self.cores = others / elapsed if elapsed > 0 else None


class NoiseMonitor(threading.Thread):
    """Samples, once a second, how much CPU the rest of the machine uses.
    ``mark(label)`` starts a new accounting period (None: stop counting);
    ``summary(label)`` is that period's average."""

    def __init__(self, interval_s: float = 1.0) -> None:
        super().__init__(name="noise-monitor", daemon=True)
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.periods: dict[str, dict[str, float]] = {}
        self.label: str | None = None
        self._last_sys = system_cpu()
        self._last_own = own_cpu()
        self._last_t = time.monotonic()

    def _sample(self) -> None:
        now = time.monotonic()
        busy, steal = system_cpu()
        own = own_cpu()
        others = others_cpu_s(busy - self._last_sys[0], self._last_own, own)
        with self.lock:
            if self.label is not None:
                p = self.periods.setdefault(
                    self.label, {"seconds": 0.0, "others_cpu_s": 0.0, "steal_s": 0.0}
                )
                p["seconds"] += now - self._last_t
                p["others_cpu_s"] += others
                p["steal_s"] += max(0.0, steal - self._last_sys[1])
        self._last_sys, self._last_own, self._last_t = (busy, steal), own, now

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self._sample()

    def mark(self, label: str | None) -> None:
        with contextlib.suppress(Exception):
            self._sample()
        with self.lock:
            self.label = label

    def stop(self) -> None:
        self.mark(None)
        self.stop_event.set()

    def summary(self, label: str) -> dict[str, float] | None:
        with self.lock:
            p = self.periods.get(label)
        if not p or p["seconds"] <= 0:
            return None
        return {
            "seconds": p["seconds"],
            "others_cores": p["others_cpu_s"] / p["seconds"],
            "steal_cores": p["steal_s"] / p["seconds"],
        }


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
