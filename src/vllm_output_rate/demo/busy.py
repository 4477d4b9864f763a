"""How much of the machine other programs took while the demo measured.

The demo compares runs taken one after the other on a machine it may
share. Its figures mean something only if the rest of the machine left
the servers their CPU in every run. ``OthersCpu`` counts, over a ``with``
block, the CPU time the whole machine was busy (``/proc/stat``) minus what
this process and its descendants (the servers, their engines) used
(``/proc/PID/stat``): ``cores`` is the average number of cores the rest of
the machine kept busy, ``share`` that as a share of all cores.

Why this and not, say, the engine's step time: a step's time depends on
the scene (a stock engine batches the hog's streams, a limited one does
not), so it cannot tell a busy machine from the scene's own work; the CPU
others take does not depend on what the demo runs. Where ``/proc`` cannot
be read (not Linux), ``cores`` stays None: the demo then says it cannot tell.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")
# user, nice, system, (idle, iowait), irq, softirq: the busy fields of /proc/stat
BUSY_FIELDS = (0, 1, 2, 5, 6)


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot."""
    fields = (PROC / "stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children)."""
    try:
        text = (PROC / pid / "stat").read_text()
    except OSError:
        return None  # gone meanwhile
    # The command name, in parentheses, may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return int(fields[1]), ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_s(root: int | None = None) -> dict[int, float]:
    """pid -> CPU seconds, for ``root`` (default: this process) and all its
    descendants."""
    stats = {
        int(p.name): s
        for p in PROC.iterdir()
        if p.name.isdigit()
        if (s := _stat(p.name))
    }
    root = os.getpid() if root is None else root
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent]
        tree.update(children)
        frontier += children
    return {pid: stats[pid][1] for pid in tree if pid in stats}


def others_cpu_s(
    busy_delta_s: float, own_before: dict[int, float], own_after: dict[int, float]
) -> float:
    """CPU seconds the rest of the machine used over a period: the machine's
    busy time minus ours (a process born in the period counts from zero)."""
    own = sum(cpu - own_before.get(pid, 0.0) for pid, cpu in own_after.items())
    return max(0.0, busy_delta_s - own)


class OthersCpu:
    """The CPU everything but this process tree used over a ``with`` block."""

    cores: float | None = None
    share: float | None = None

    def __enter__(self) -> OthersCpu:
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._sample()
        if self._start is None or end is None:
            return
        (t0, busy0, own0), (t1, busy1, own1) = self._start, end
        if t1 > t0:
            self.cores = others_cpu_s(busy1 - busy0, own0, own1) / (t1 - t0)
            self.share = self.cores / (os.cpu_count() or 1)

    @staticmethod
    def _sample() -> tuple[float, float, dict[int, float]] | None:
        try:
            return time.monotonic(), machine_busy_s(), own_cpu_s()
        except (OSError, ValueError, IndexError):
            return None
