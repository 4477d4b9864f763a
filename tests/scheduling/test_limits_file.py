"""Reloading the limits file when it changes."""

from __future__ import annotations

import os

from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling.limits_file import LimitsFileWatcher


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_changed_file_is_applied_and_a_broken_one_ignored(tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    write(
        limits,
        "default_user_output_tokens_per_second: 10\n"
        "user_output_tokens_per_second: {a: 5, b: 7}\n",
        1_000,
    )
    errors: list[str] = []
    clock = Clock()
    limiter = OutputRateLimiter(10, {"a": 5, "b": 7, "flag-user": 3})
    watcher = LimitsFileWatcher(str(limits), errors.append, clock=clock)

    write(limits, "default_user_output_tokens_per_second: 20\n"
          "user_output_tokens_per_second: {a: 50}\n", 2_000)  # fmt: skip
    assert not watcher.poll(limiter)  # checked at most once a second
    clock.now = 1.5
    assert watcher.poll(limiter)
    assert limiter.default_rate == 20
    # b left the file and falls back to the default; others are untouched.
    assert limiter.user_rates == {"a": 50, "flag-user": 3}

    write(limits, "user_output_tokens_per_second: {a: -1}\n", 3_000)
    clock.now = 3.0
    assert not watcher.poll(limiter)
    assert errors and "-1" in errors[0]
    assert limiter.user_rates == {"a": 50, "flag-user": 3}
    clock.now = 4.5
    assert not watcher.poll(limiter)  # unchanged since the broken version
