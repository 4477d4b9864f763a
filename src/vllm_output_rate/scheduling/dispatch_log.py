"""An engine-side record of every dispatched sampling step (no vLLM import).

Client-side timing sees tokens after HTTP buffering; the scheduler knows when
it dispatched each user's token. With ``VLLM_OUTPUT_RATE_DISPATCH_LOG=FILE``
the scheduler appends one CSV line ``monotonic_ns,user`` per dispatched token,
written in batches (every 4096 tokens, and at least once a second, so that a
test can read a running server's log) so a step pays one list extend per
user. Benchmarks read it to report the gap between a user's consecutive
tokens.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import TextIO

ENV = "VLLM_OUTPUT_RATE_DISPATCH_LOG"
FLUSH_EVERY = 4096
FLUSH_EVERY_NS = 1_000_000_000


class DispatchLog:
    def __init__(self, path: str) -> None:
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._pending: list[str] = []
        self._flushed_ns = 0
        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> DispatchLog | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def record(self, time_ns: int, served: Mapping[str, int]) -> None:
        """One step: ``served`` maps users to tokens dispatched at ``time_ns``."""
        for user, count in served.items():
            self._pending.extend([f"{time_ns},{user}\n"] * count)
        if (
            len(self._pending) >= FLUSH_EVERY
            or time_ns - self._flushed_ns >= FLUSH_EVERY_NS
        ):
            self._flushed_ns = time_ns
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
