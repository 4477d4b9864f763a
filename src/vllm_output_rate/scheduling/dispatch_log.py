"""An engine-side record of every dispatched sampling step (no vLLM import).

Client-side timing sees tokens after HTTP buffering; the scheduler knows when
it dispatched each user's token. With ``VLLM_OUTPUT_RATE_DISPATCH_LOG=FILE``
the scheduler appends one CSV line ``monotonic_ns,user`` per dispatched token,
stamped with the clock reading of its step's reservation (when the limiter
admitted it, at the start of ``schedule()``; with speculative decoding, of
the step that dispatched it). Lines are written in batches so a step pays one
list extend per user: every ``FLUSH_EVERY`` lines, and at the first step a
second after the oldest line not yet written, so that a reader of a running
server sees all but the last second. Benchmarks and tests read it to judge
rates at the engine.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import TextIO

ENV = "VLLM_OUTPUT_RATE_DISPATCH_LOG"
FLUSH_EVERY = 4096
FLUSH_AFTER_NS = 1_000_000_000


class DispatchLog:
    def __init__(self, path: str) -> None:
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._pending: list[str] = []
        self._oldest_pending_ns = 0
        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> DispatchLog | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def record(self, time_ns: int, served: Mapping[str, int]) -> None:
        """One step: ``served`` maps users to tokens dispatched at ``time_ns``."""
        pending = self._pending
        if not pending:
            self._oldest_pending_ns = time_ns
        for user, count in served.items():
            pending.extend([f"{time_ns},{user}\n"] * count)
        if (
            len(pending) >= FLUSH_EVERY
            or time_ns - self._oldest_pending_ns >= FLUSH_AFTER_NS
        ):
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.writelines(self._pending)
            self._pending.clear()
        self._file.flush()


def read_dispatch_log(path: str) -> dict[str, list[int]]:
    """user -> sorted dispatch times (ns)."""
    times: dict[str, list[int]] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            time_ns, _, user = line.rstrip("\n").partition(",")
            times.setdefault(user, []).append(int(time_ns))
    for values in times.values():
        values.sort()
    return times
