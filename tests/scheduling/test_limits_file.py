"""Reloading the limits file when it changes."""

from __future__ import annotations

import os

from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.scheduling.limits_file import LimitsFileWatcher
from vllm_output_rate.teams import Teams


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


def test_weights_and_floors_reload_with_the_limits(tmp_path) -> None:
    from vllm_output_rate.scheduling.fair_share import FairShare

    limits = tmp_path / "limits.yaml"
    write(limits, "default_user_output_tokens_per_second: 100\n"
          "user_output_weight: {a: 2, b: 3}\n", 1_000)  # fmt: skip
    errors: list[str] = []
    clock = Clock()
    limiter = OutputRateLimiter(100)
    fair = FairShare({"a": 2, "b": 3, "flag-user": 5})
    watcher = LimitsFileWatcher(str(limits), errors.append, clock=clock, capacity=300)

    write(limits, "default_user_output_tokens_per_second: 100\n"
          "user_output_weight: {a: 4}\n"
          "user_min_output_tokens_per_second: {a: 50}\n", 2_000)  # fmt: skip
    clock.now = 1.5
    assert watcher.poll(limiter, fair)
    # b left the file: back to weight 1; the flag's user is untouched.
    assert fair.weights == {"a": 4.0, "flag-user": 5} and fair.floors == {"a": 50.0}

    # Floors beyond the declared capacity: refused, nothing changes.
    write(limits, "default_user_output_tokens_per_second: 200\n"
          "user_min_output_tokens_per_second: {a: 100, c: 100, d: 100.5}\n",
          3_000)  # fmt: skip
    clock.now = 3.0
    assert not watcher.poll(limiter, fair)
    assert "more than the engine capacity" in errors[-1]
    assert fair.floors == {"a": 50.0} and fair.weights["a"] == 4.0
    assert limiter.default_rate == 100


def test_prompt_rates_reload_with_the_limits(tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    write(limits, "default_user_output_tokens_per_second: 100\n"
          "default_user_prompt_tokens_per_second: 1000\n"
          "user_prompt_tokens_per_second: {hog: 200, b: 300}\n", 1_000)  # fmt: skip
    errors: list[str] = []
    clock = Clock()
    limiter = OutputRateLimiter(100)
    prompt = OutputRateLimiter(1000, {"hog": 200, "b": 300, "flag-user": 50})
    watcher = LimitsFileWatcher(str(limits), errors.append, clock=clock)

    write(limits, "default_user_output_tokens_per_second: 100\n"
          "default_user_prompt_tokens_per_second: 2000\n"
          "user_prompt_tokens_per_second: {hog: 100}\n", 2_000)  # fmt: skip
    clock.now = 1.5
    assert watcher.poll(limiter, None, prompt) and not errors
    assert prompt.default_rate == 2000
    # b left the file: the default; a user of the flags stays as it was.
    assert prompt.user_rates == {"hog": 100, "flag-user": 50}
    assert limiter.user_rates == {}  # output limits untouched by prompt rates

    # A bad prompt rate: nothing of the file applies, the error names it.
    write(limits, "default_user_output_tokens_per_second: 50\n"
          "user_prompt_tokens_per_second: {hog: -1}\n", 3_000)  # fmt: skip
    clock.now = 3.0
    assert not watcher.poll(limiter, None, prompt)
    (error,) = errors
    assert "user_prompt_tokens_per_second" in error and "-1" in error
    assert limiter.default_rate == 100 and prompt.user_rates["hog"] == 100


def test_prompt_rates_while_prompt_limiting_is_off_change_nothing(tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    write(limits, "default_user_output_tokens_per_second: 10\n", 1_000)
    errors: list[str] = []
    clock = Clock()
    limiter = OutputRateLimiter(10)
    watcher = LimitsFileWatcher(str(limits), errors.append, clock=clock)

    write(limits, "default_user_output_tokens_per_second: 20\n"
          "user_prompt_tokens_per_second: {hog: 100}\n", 2_000)  # fmt: skip
    clock.now = 1.5
    assert not watcher.poll(limiter)  # all or nothing
    assert limiter.default_rate == 10
    (error,) = errors
    assert "prompt limiting is off" in error and "start-up" in error


class Holder:
    """Stands in for the policy: the teams in force."""

    def __init__(self, teams: Teams | None) -> None:
        self.teams = teams

    def current_teams(self) -> Teams | None:
        return self.teams

    def use_teams(self, teams: Teams) -> None:
        self.teams = teams


def test_teams_reload_with_the_limits(tmp_path) -> None:
    limits = tmp_path / "limits.yaml"
    write(
        limits,
        "default_user_output_tokens_per_second: 10\n"
        "teams: {crew: {output_tokens_per_second: 40, members: [a, b]}}\n",
        1_000,
    )
    errors: list[str] = []
    clock = Clock()
    limiter = OutputRateLimiter(10)
    # "ops" came from the flags: the file never states it, so it stays.
    holder = Holder(Teams({"crew": 40.0, "ops": 9.0}, {"a": "crew", "b": "crew"}))
    watcher = LimitsFileWatcher(str(limits), errors.append, clock=clock)

    write(limits, "default_user_output_tokens_per_second: 10\n"
          "teams: {crew: {output_tokens_per_second: 20, members: [a]},"
          " new: {output_tokens_per_second: 5, members: [b]}}\n", 2_000)  # fmt: skip
    clock.now = 1.5
    assert watcher.poll(limiter, team_holder=holder), errors
    assert holder.teams == Teams(
        {"crew": 20.0, "ops": 9.0, "new": 5.0}, {"a": "crew", "b": "new"}
    )

    # A user in two teams: nothing applies.
    write(limits, "default_user_output_tokens_per_second: 10\n"
          "teams: {crew: {output_tokens_per_second: 20, members: [a]},"
          " new: {output_tokens_per_second: 5, members: [a]}}\n", 3_000)  # fmt: skip
    clock.now = 3.0
    assert not watcher.poll(limiter, team_holder=holder)
    assert "already a member" in errors[-1]
    assert set(holder.teams.rates) == {"crew", "ops", "new"}

    # Teams the file no longer states are dropped; the flags' stays.
    write(limits, "default_user_output_tokens_per_second: 10\n", 4_000)
    clock.now = 4.5
    assert watcher.poll(limiter, team_holder=holder)
    assert holder.teams == Teams({"ops": 9.0}, {})
