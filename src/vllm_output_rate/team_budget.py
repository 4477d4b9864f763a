"""Two budgets per request: its user's and its team's (no vLLM import).

``TeamBudget`` is the policy's ``budget.Budget`` when teams are configured
(``teams.py``): it stands in front of the users' budget (the embedded
limiter, or the shared store's) and keeps one GCRA limiter of its own, keyed
by team, at each team's limit. The policy sees one budget per user, as
without teams:

* ``take_many``: the users' budget grants first; the members' grants of each
  team are then taken from the team's limiter in one call, and when the team
  grants less, its tokens go to the members that got fewest so far (one at a
  time, so that members of a team alternate step after step) and the rest
  goes back to the users' budget. A token is granted only when both allow
  it, so each budget's bound holds for it alone: a team's members receive
  at most ``(W + 0.1) x limit + 1`` tokens together in any W seconds.
* refunds go to both; a late refund (speculative decoding's drafts that a
  later report rejects) goes to the user only: the team's later takes are
  not known here, so the team stays charged, never under.
* what a user may take at once or when it may take again is the stricter
  of the two.

Users in no team go straight to the users' budget, so with no team among
a step's users it costs one set intersection more than without teams.

The teams' limiter is embedded by default; with a shared store it is a
second leased budget keyed by team (``shared``), so that one team's limit
holds over every engine, and the store keeps the members beside the teams'
limits: a change here is written there, one made elsewhere is adopted
between steps. Its demand is its members' unfinished requests, summed per
team whenever they change.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, KeysView, Mapping
from itertools import repeat
from typing import Any, Protocol

from vllm_output_rate.budget import Budget
from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.teams import Teams, group_by_team


class SharedTeams(Budget, Protocol):
    """A teams' budget shared through a store, which keeps the members too
    (``store.leases.LeasedLimiter``)."""

    members: dict[str, str]
    on_members: Callable[[dict[str, str]], None] | None

    def update_members(
        self, members: Mapping[str, str], remove: Iterable[str] = ()
    ) -> None: ...


class TeamBudget:
    """A user's budget and its team's, as one ``Budget``."""

    def __init__(
        self,
        users: Budget,
        teams: Teams,
        *,
        shared: SharedTeams | None = None,
        changes_of: Callable[[], int] | None = None,
    ) -> None:
        """``shared``: the teams' budget leased from a store (keyed by team,
        at the teams' limits), else an embedded one; ``changes_of``: a count
        that changes whenever a user's unfinished requests do (the demand
        a shared budget is told of is summed again then)."""
        self.users = users
        # Keyed by team name; no default rate is ever used (every team has
        # its own), so the first team's stands in for it.
        # (``is None``: a budget with no users yet has a length of 0.)
        self.teams: Budget = (
            shared
            if shared is not None
            else OutputRateLimiter(
                next(iter(teams.rates.values()), 1.0),
                teams.rates,
                burst_ns=users.burst_ns,
                clock=users.now_ns,
            )
        )
        self._shared = shared
        if shared is not None:
            shared.on_members = self._adopt_members
        self._changes_of = changes_of
        self._team_demand: dict[str, int] = {}
        # Tokens granted per member while its team was short (fair turns).
        self.served: Counter[str] = Counter()
        self._use_members(teams.team_of)
        # Each team's tokens taken less those given back: its members'
        # tokens dispatched (for operators; late refunds stay counted).
        self.charged: Counter[str] = Counter()

    def set_teams(self, teams: Teams) -> None:
        """New teams (an operator's change): each team that stays keeps its
        pacing state, a changed limit binds from the next take."""
        held = self.team_rates
        removed = held.keys() - teams.rates.keys()
        # Only what changed: a shared budget writes it to the store for every
        # engine, and must not write back a limit another engine changed.
        changed = {
            team: rate for team, rate in teams.rates.items() if held.get(team) != rate
        }
        if self._shared is not None:
            moved = {
                user: team
                for user, team in teams.team_of.items()
                if self.team_of.get(user) != team
            }
            left = [user for user in self.team_of if user not in teams.team_of]
            if moved or left:
                self._shared.update_members(moved, left)
        self.teams.update_rates(user_rates=changed, remove_users=removed)
        self._use_members(teams.team_of)

    def _adopt_members(self, members: dict[str, str]) -> None:
        """Another engine changed the members (read from the store, with the
        teams' limits, which were adopted first)."""
        held = self.team_rates
        self._use_members({u: t for u, t in members.items() if t in held})

    def _use_members(self, team_of: Mapping[str, str]) -> None:
        self.team_of = dict(team_of)
        self._members = group_by_team(team_of, team_of)
        self.served = Counter(
            {user: count for user, count in self.served.items() if user in team_of}
        )
        self._demand_seen: object = None  # members moved: sum the demand again

    @property
    def team_rates(self) -> dict[str, float]:
        """Each team's limit, as the teams' budget holds it (with a shared
        store, another engine may have changed it)."""
        return self.teams.user_rates

    # ----- what the policy reads ------------------------------------------

    @property
    def burst_ns(self) -> int:
        return self.users.burst_ns

    @property
    def default_rate(self) -> float:
        return self.users.default_rate

    @property
    def user_rates(self) -> dict[str, float]:
        return self.users.user_rates

    @property
    def last_take_ns(self) -> int:
        return self.users.last_take_ns

    def now_ns(self) -> int:
        return self.users.now_ns()

    def rate_of(self, user: str) -> float:
        rate = self.users.rate_of(user)
        team = self.team_of.get(user)
        return rate if team is None else min(rate, self.teams.rate_of(team))

    def current_teams(self) -> Teams:
        """The teams' limits and members as this budget holds them."""
        return Teams(rates=self.team_rates, team_of=self.team_of)

    def teams_snapshot(self) -> dict[str, dict[str, float]]:
        """Each configured team's limit, members and tokens so far."""
        members: Counter[str] = Counter(self.team_of.values())
        return {
            team: {
                "limit": rate,
                "members": members[team],
                "tokens": self.charged[team],
            }
            for team, rate in self.team_rates.items()
        }

    # ----- taking and giving back ----------------------------------------

    def take_many(self, wanted: Mapping[str, int]) -> dict[str, int]:
        got = self.users.take_many(wanted)
        if self.team_of.keys().isdisjoint(got):
            return got
        asked = self._per_team(got)
        if not asked:
            return got
        granted = self.teams.take_many(asked)
        self.charged.update(granted)
        unused: dict[str, int] = {}
        for team, count in asked.items():
            if granted[team] < count:
                members = [u for u in self._members[team] if got.get(u, 0) > 0]
                self._divide(granted[team], members, got, unused)
        if unused:
            self.users.refund_many(unused)
        return got

    def _per_team(self, counts: Mapping[str, int]) -> dict[str, int]:
        """``counts`` per user (tokens got, unfinished requests) summed per
        team (teams whose members count none left out)."""
        if len(counts) * 4 < len(self.team_of):
            per_team: Counter[str] = Counter()
            team_of = self.team_of
            for user, count in counts.items():
                team = team_of.get(user)
                if team is not None and count > 0:
                    per_team[team] += count
            return dict(per_team)
        # Most members counted (a full engine): a sum per team, with no
        # Python step per member.
        get = counts.get
        totals = {
            team: sum(map(get, members, repeat(0)))
            for team, members in self._members.items()
        }
        return {team: total for team, total in totals.items() if total > 0}

    def _divide(
        self,
        tokens: int,
        members: list[str],
        got: dict[str, int],
        unused: dict[str, int],
    ) -> None:
        """Give ``tokens`` of a team to its ``members`` one at a time, each to
        the member served least so far among those that still want one;
        what a member got from its own budget beyond that is ``unused``."""
        served = self.served
        # A member back after a pause is at most one round of turns behind,
        # not owed every turn it missed.
        behind = max(served[user] for user in members) - len(members)
        for user in members:
            if served[user] < behind:
                served[user] = behind
        wants = {user: got[user] for user in members}
        kept = dict.fromkeys(members, 0)
        heap = [(served[user], user) for user in members]
        heapq.heapify(heap)
        while tokens and heap:
            count, user = heapq.heappop(heap)
            kept[user] += 1
            served[user] += 1
            tokens -= 1
            if kept[user] < wants[user]:
                heapq.heappush(heap, (count + 1, user))
        for user in members:
            if kept[user] < wants[user]:
                unused[user] = wants[user] - kept[user]
                got[user] = kept[user]

    def take_up_to(self, user: str, wanted: int) -> int:
        return self.take_many({user: wanted})[user]

    def refund(self, user: str, count: int = 1) -> None:
        self.users.refund(user, count)
        team = self.team_of.get(user)
        if team is not None and count > 0:
            self.teams.refund(team, count)
            self.charged[team] -= count

    def refund_many(self, counts: Mapping[str, int]) -> None:
        self.users.refund_many(counts)
        team_of = self.team_of
        if team_of.keys().isdisjoint(counts):
            return
        by_team: Counter[str] = Counter()
        for user, count in counts.items():
            team = team_of.get(user)
            if team is not None and count > 0:
                by_team[team] += count
        self.teams.refund_many(by_team)
        self.charged.subtract(by_team)

    def refunds_absorbed(self, users: KeysView[str]) -> bool:
        if not self.users.refunds_absorbed(users):
            return False
        team_of = self.team_of
        teams = {team_of[user] for user in users if user in team_of}
        return not teams or self.teams.refunds_absorbed(dict.fromkeys(teams).keys())

    def refund_late(
        self, user: str, count: int, later_takes: Iterable[tuple[int, int]] = ()
    ) -> None:
        # The team keeps the charge: its later takes (every member's) are
        # not known here, and giving back without them could over-refund.
        self.users.refund_late(user, count, later_takes)

    # ----- limits ----------------------------------------------------------

    def tokens_within(self, user: str, window_ns: int) -> int:
        within = self.users.tokens_within(user, window_ns)
        team = self.team_of.get(user)
        if team is None:
            return within
        return min(within, self.teams.tokens_within(team, window_ns))

    def ready_at_ns(self, user: str) -> int:
        ready = self.users.ready_at_ns(user)
        team = self.team_of.get(user)
        if team is None:
            return ready
        return max(ready, self.teams.ready_at_ns(team))

    def cleanup_idle_users(self) -> int:
        return self.users.cleanup_idle_users() + self.teams.cleanup_idle_users()

    def update_rates(
        self,
        *,
        default_rate: float | None = None,
        user_rates: Mapping[str, float] | None = None,
        remove_users: Iterable[str] = (),
    ) -> None:
        self.users.update_rates(
            default_rate=default_rate, user_rates=user_rates, remove_users=remove_users
        )

    # ----- the shared store's hooks -----------------------------------------

    def attach(self, has_requests: Callable[[], bool]) -> None:
        self.users.attach(has_requests)
        self.teams.attach(has_requests)

    def between_steps(self, demand: Mapping[str, int], generation: object) -> None:
        self.users.between_steps(demand, generation)
        if self._shared is None:
            return
        seen = (generation, self._changes_of() if self._changes_of else None)
        if seen != self._demand_seen:
            self._demand_seen = seen
            # A new object: the leases note the change (``LeasedLimiter``).
            self._team_demand = self._per_team(demand)
        self.teams.between_steps(self._team_demand, self._demand_seen)

    def apply_pending(self) -> None:
        self.users.apply_pending()
        self.teams.apply_pending()

    def store_snapshot(self) -> dict[str, Any] | None:
        return self.users.store_snapshot()

    def team_store_snapshot(self) -> dict[str, Any] | None:
        """The teams' leases, when they are shared through a store."""
        return None if self._shared is None else self._shared.store_snapshot()
