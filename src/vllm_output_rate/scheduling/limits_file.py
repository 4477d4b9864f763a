"""Reload the limits file when it changes (no vLLM import).

The scheduler asks at most once a second whether the file's modification
time changed; on a change it applies the file's default and user limits,
weights and floors, prompt-token rates and teams (each team it states
replaced whole), and users that left the file fall back to the default
(limit, weight 1, no floor, the default prompt rate; teams it no longer
states are dropped). All or nothing: a file that fails to parse, or that states prompt
rates while prompt limiting is off (it is turned on at start-up only), is
logged and ignored, and the limits in force stay as they were.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

from vllm_output_rate.budget import Budget
from vllm_output_rate.config import FileLimits, read_file_limits
from vllm_output_rate.fair_settings import check_floors
from vllm_output_rate.scheduling.fair_share import FairShare
from vllm_output_rate.teams import Teams, changed_teams, check_team_floors
from vllm_output_rate.validation import OutputRateConfigError

CHECK_INTERVAL_S = 1.0


class TeamHolder(Protocol):
    """Who holds the teams in force (the policy)."""

    def current_teams(self) -> Teams | None:
        """The teams in force, each limit as it is now."""
        ...

    def use_teams(self, teams: Teams) -> None: ...


class LimitsFileWatcher:
    def __init__(
        self,
        path: str,
        on_error: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        capacity: float | None = None,
    ) -> None:
        self._capacity = capacity
        self._path = path
        self._on_error = on_error
        self._clock = clock
        self._next_check = clock() + CHECK_INTERVAL_S
        self._mtime = self._read_mtime()
        loaded = self._load()
        self._file_users = set(loaded.users) if loaded else set()
        self._fair_users = set(loaded.weights) | set(loaded.floors) if loaded else set()
        self._file_prompt_users = set(loaded.prompt[1]) if loaded else set()
        self._file_teams = set(loaded.teams.rates) if loaded and loaded.teams else set()

    def _read_mtime(self) -> float | None:
        try:
            return os.stat(self._path).st_mtime_ns
        except OSError:
            return None

    def _load(self) -> FileLimits | None:
        try:
            return read_file_limits(self._path)
        except OutputRateConfigError as exc:
            self._on_error(f"limits file not reloaded: {exc}")
            return None

    def poll(
        self,
        limiter: Budget,
        fair: FairShare | None = None,
        prompt_limiter: Budget | None = None,
        team_holder: TeamHolder | None = None,
    ) -> bool:
        """Apply the file if it changed since the last look; True if applied.
        ``fair`` gets the file's weights and floors, ``prompt_limiter`` (None:
        prompt limiting off) its prompt rates, ``team_holder`` its teams (the
        teams it stated before and no longer does are dropped); all or
        nothing."""
        now = self._clock()
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_INTERVAL_S
        mtime = self._read_mtime()
        if mtime is None or mtime == self._mtime:
            return False
        self._mtime = mtime
        loaded = self._load()
        if loaded is None:
            return False
        default, users = loaded.default, loaded.users
        weights, floors = loaded.weights, loaded.floors
        prompt_default, prompt_users = loaded.prompt
        try:
            if prompt_limiter is None and (prompt_default is not None or prompt_users):
                raise OutputRateConfigError(
                    "it states prompt-token rates, and prompt limiting is off (it "
                    "is turned on at start-up, with a default prompt rate)"
                )
            gone = self._fair_users - set(weights) - set(floors)
            new_floors = dict(floors)
            if fair is not None:
                ceiling = default if default is not None else limiter.default_rate
                kept = {u: f for u, f in fair.floors.items() if u not in gone}
                new_floors = {**kept, **floors}
                check_floors(
                    new_floors,
                    lambda u: users.get(u, ceiling),
                    self._capacity,
                    f"limits file {self._path}",
                )
            teams = None
            if team_holder is not None and (loaded.teams or self._file_teams):
                stated = loaded.teams or Teams()
                current = team_holder.current_teams() or Teams()
                # The file's teams it no longer states (unless already gone).
                dropped = (
                    self._file_teams - stated.rates.keys()
                ) & current.rates.keys()
                teams = changed_teams(current, stated, dropped)
                check_team_floors(teams, new_floors, self._capacity)
        except OutputRateConfigError as exc:
            self._on_error(f"limits file not reloaded: {exc}")
            return False
        try:
            limiter.update_rates(
                default_rate=default,
                user_rates=users,
                remove_users=self._file_users - set(users),
            )
        except ValueError as exc:
            self._on_error(f"limits file not reloaded: {exc}")
            return False
        self._file_users = set(users)
        if prompt_limiter is not None:
            prompt_limiter.update_rates(
                default_rate=prompt_default,
                user_rates=prompt_users,
                remove_users=self._file_prompt_users - set(prompt_users),
            )
            self._file_prompt_users = set(prompt_users)
        if fair is not None:
            fair.update(weights, floors, remove_users=gone)
        self._fair_users = set(weights) | set(floors)
        if team_holder is not None and teams is not None:
            team_holder.use_teams(teams)
            self._file_teams = set(loaded.teams.rates) if loaded.teams else set()
        return True
