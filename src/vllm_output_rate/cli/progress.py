"""The load command's live progress line on stderr."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from vllm_output_rate.loadtest import ProgressSnapshot


class ProgressLine:
    """Elapsed time and tokens per user on stderr: one line rewritten in
    place on a terminal, a new line every ``plain_every_s`` otherwise."""

    def __init__(self, stream: TextIO | None = None, plain_every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.plain_every_s = plain_every_s
        self._last_plain = -math.inf
        self._width = 0

    @staticmethod
    def render(s: ProgressSnapshot) -> str:
        users = "  ".join(
            f"{label} {tokens:,} tok" for label, tokens in s.tokens.items()
        )
        failed = sum(s.requests_failed.values())
        text = (
            f"[{min(s.elapsed_s, 9999):6.1f}s / {s.duration_s:g}s] {users}"
            f"  | in flight {s.in_flight}"
        )
        if failed:
            text += f"  | {failed} failed"
        return text

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        text = self.render(snapshot)
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
            if snapshot.done:
                self.stream.write("\n")
        else:
            now = time.monotonic()
            if not snapshot.done and now - self._last_plain < self.plain_every_s:
                return
            self._last_plain = now
            self.stream.write(text + "\n")
        self.stream.flush()
