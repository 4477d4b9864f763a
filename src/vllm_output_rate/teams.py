"""Teams over users: the settings (no vLLM import).

A team has members and an output-token limit of its own, in tokens per
second, paced like a user's (GCRA, 100 ms burst). A member is charged to its
own budget and to its team's: a token is sampled only when both allow it
(``team_budget.py``). A user belongs to at most one team; a user in no team
behaves exactly as without teams.

The key sits beside the limits in a limits file and in
``additional_config['output_rate']``, and the flag ``--output-rate-teams``
takes the same JSON; they layer team by team (``layered_teams``)::

    {"teams": {"research": {"output_tokens_per_second": 100,
                            "members": ["alice", "bob"]}}}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.fair_settings import MAX_WEIGHT
from vllm_output_rate.validation import (
    OutputRateConfigError,
    parsed_json,
    validate_number,
    validate_rate,
    validate_user_name,
)

TEAMS_KEY = "teams"
REMOVE_TEAMS_KEY = "remove_teams"  # the admin API's: teams to drop
TEAMS_FLAG = "--output-rate-teams"
TEAM_RATE_KEY = "output_tokens_per_second"
MEMBERS_KEY = "members"
TEAM_WEIGHT_KEY = "weight"  # in the fair shares of a full engine (default 1)
TEAM_FLOOR_KEY = "min_output_tokens_per_second"  # the members' together
TEAM_KEYS = (TEAM_RATE_KEY, MEMBERS_KEY, TEAM_WEIGHT_KEY, TEAM_FLOOR_KEY)
DEFAULT_TEAM_WEIGHT = 1.0
# More teams or members than this is a configuration mistake, not a use.
MAX_TEAMS = 100_000
MAX_MEMBERS = 1_000_000


@dataclass(frozen=True)
class Teams:
    """Each team's limit (tok/s), each member's team, each team's weight
    where it is not the default, and each team's floor where it has one."""

    rates: Mapping[str, float] = field(default_factory=dict)
    team_of: Mapping[str, str] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    floors: Mapping[str, float] = field(default_factory=dict)

    def to_config(self) -> dict[str, Any]:
        """The ``teams`` key of ``additional_config['output_rate']``."""
        members = group_by_team(self.team_of, sorted(self.team_of))
        teams: dict[str, dict[str, Any]] = {}
        for team, rate in self.rates.items():
            teams[team] = {TEAM_RATE_KEY: rate, MEMBERS_KEY: members.get(team, [])}
            if team in self.weights:
                teams[team][TEAM_WEIGHT_KEY] = self.weights[team]
            if team in self.floors:
                teams[team][TEAM_FLOOR_KEY] = self.floors[team]
        return {TEAMS_KEY: teams}


def _join(team_of: dict[str, str], user: str, team: str, where: str) -> None:
    """Put ``user`` in ``team``: refused if it is in another one already."""
    other = team_of.get(user)
    if other is not None:
        raise OutputRateConfigError(
            f"{where}: user {user!r} is already a member of team {other!r}; "
            "a user belongs to at most one team"
        )
    team_of[user] = team


def parse_teams(value: object, where: str) -> Teams | None:
    """The teams ``value`` states, checked whole (None: no teams)."""
    value = parsed_json(value, where)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{where}: expected an object of teams, e.g. "
            '{"research": {"output_tokens_per_second": 100, "members": ["alice"]}}, '
            f"got {type(value).__name__}"
        )
    if len(value) > MAX_TEAMS:
        raise OutputRateConfigError(f"{where}: more than {MAX_TEAMS:,} teams")
    rates: dict[str, float] = {}
    team_of: dict[str, str] = {}
    weights: dict[str, float] = {}
    floors: dict[str, float] = {}
    for name, team in value.items():
        team_name = validate_user_name(name, f"{where}: team name")
        at = f"{where}[{name!r}]"
        if not isinstance(team, Mapping):
            raise OutputRateConfigError(
                f"{at}: expected an object with {TEAM_RATE_KEY!r} and {MEMBERS_KEY!r}"
            )
        unknown = sorted(set(team) - set(TEAM_KEYS))
        if unknown:
            raise OutputRateConfigError(
                f"{at}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"a team has {', '.join(map(repr, TEAM_KEYS))}"
            )
        if TEAM_RATE_KEY not in team:
            raise OutputRateConfigError(f"{at}: {TEAM_RATE_KEY!r} is missing")
        rates[team_name] = validate_rate(
            team[TEAM_RATE_KEY], f"{at}[{TEAM_RATE_KEY!r}]"
        )
        if TEAM_WEIGHT_KEY in team:
            at_weight = f"{at}[{TEAM_WEIGHT_KEY!r}]"
            weight = validate_number(team[TEAM_WEIGHT_KEY], at_weight)
            if weight > MAX_WEIGHT:
                raise OutputRateConfigError(
                    f"{at_weight} must be at most {MAX_WEIGHT:g}, got {weight:g}"
                )
            if weight != DEFAULT_TEAM_WEIGHT:
                weights[team_name] = weight
        if TEAM_FLOOR_KEY in team:
            at_floor = f"{at}[{TEAM_FLOOR_KEY!r}]"
            floor = validate_rate(team[TEAM_FLOOR_KEY], at_floor)
            if floor > rates[team_name]:
                raise OutputRateConfigError(
                    f"{at_floor}: {floor:g} tok/s is above the team's limit of "
                    f"{rates[team_name]:g} tok/s"
                )
            floors[team_name] = floor
        members = team.get(MEMBERS_KEY, [])
        if not isinstance(members, list):
            raise OutputRateConfigError(
                f"{at}[{MEMBERS_KEY!r}]: expected a list of user names"
            )
        for member in members:
            user = validate_user_name(member, f"{at}[{MEMBERS_KEY!r}]: member")
            _join(team_of, user, team_name, at)
        if len(team_of) > MAX_MEMBERS:
            raise OutputRateConfigError(f"{where}: more than {MAX_MEMBERS:,} members")
    return Teams(rates, team_of, weights, floors)


def changed_teams(
    current: Teams | None, given: Teams | None, remove: Iterable[str]
) -> Teams:
    """``current`` with each team of ``given`` replaced whole (its limit and
    members) and the teams in ``remove`` dropped; refused when a user would
    be in two teams or a removed team is unknown."""
    current = current or Teams()
    given = given or Teams()
    rates = dict(current.rates)
    for team in remove:
        if team not in rates:
            raise OutputRateConfigError(f"{REMOVE_TEAMS_KEY}: unknown team {team!r}")
        del rates[team]
    rates.update(given.rates)
    team_of = {
        u: t for u, t in current.team_of.items() if t in rates and t not in given.rates
    }
    for user, team in given.team_of.items():
        _join(team_of, user, team, f"{TEAMS_KEY}[{team!r}]")
    kept = [t for t in current.rates if t in rates and t not in given.rates]
    weights = {t: current.weights[t] for t in kept if t in current.weights}
    floors = {t: current.floors[t] for t in kept if t in current.floors}
    weights.update(given.weights)
    floors.update(given.floors)
    return Teams(rates, team_of, weights, floors)


def layered_teams(lower: Teams | None, upper: Teams | None) -> Teams | None:
    """``lower``'s teams with ``upper``'s over them, team by team (a limits
    file's, then ``additional_config``'s, then the flag's): a team ``upper``
    names is replaced whole, and a user ``upper`` puts in a team leaves its
    ``lower`` one; None: neither states teams."""
    if lower is None or upper is None:
        return upper if lower is None else lower
    moved = {u: t for u, t in lower.team_of.items() if u not in upper.team_of}
    lower = Teams(lower.rates, moved, lower.weights, lower.floors)
    return changed_teams(lower, upper, ())


def check_team_floors(
    teams: Teams | None, floors: Mapping[str, float], capacity: float | None = None
) -> None:
    """A team's limit must hold its members' floors (tok/s each is promised
    whatever else runs), and the engine's declared ``capacity`` the users'
    floors and the teams' together: refused otherwise."""
    if teams is None:
        return
    total = sum(floors.values()) + sum(teams.floors.values())
    if capacity is not None and teams.floors and total > capacity:
        raise OutputRateConfigError(
            f"users' and teams' floors sum to {total:g} tok/s, more than the "
            f"engine capacity of {capacity:g} tok/s"
        )
    promised: dict[str, float] = {}
    for user, floor in floors.items():
        team = teams.team_of.get(user)
        if team is not None:
            promised[team] = promised.get(team, 0.0) + floor
    for team, total in sorted(promised.items()):
        if total > teams.rates[team]:
            raise OutputRateConfigError(
                f"team {team!r}: its members' floors add up to {total:g} tok/s, "
                f"above the team's limit of {teams.rates[team]:g} tok/s"
            )


def member_shares(
    teams: Teams, user_weight: Callable[[str], float], active: Iterable[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Each active member's weight in the fair shares of a full engine, and
    its part of its team's floor: the team's, split between the team's
    active members by their own weights (users in no team keep theirs: not
    listed)."""
    by_team = group_by_team(teams.team_of, active)
    weights: dict[str, float] = {}
    floors: dict[str, float] = {}
    for team, members in by_team.items():
        own = [user_weight(user) for user in members]
        parts = [w / sum(own) for w in own]
        team_weight = teams.weights.get(team, DEFAULT_TEAM_WEIGHT)
        weights.update(zip(members, (team_weight * p for p in parts), strict=True))
        floor = teams.floors.get(team)
        if floor is not None:
            floors.update(zip(members, (floor * p for p in parts), strict=True))
    return weights, floors


def group_by_team(
    team_of: Mapping[str, str], users: Iterable[str]
) -> dict[str, list[str]]:
    """The ``users`` that are in a team, per team, in the order given."""
    members: dict[str, list[str]] = {}
    for user in users:
        team = team_of.get(user)
        if team is not None:
            members.setdefault(team, []).append(user)
    return members
