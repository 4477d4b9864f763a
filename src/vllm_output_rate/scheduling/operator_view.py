"""What operators and observers read and change of a policy (no vLLM import).

The admin endpoint, the metrics collector, ``top`` and the shared store's
refresher go through these methods, over the engine's RPC: the limits in
force, an all-or-nothing change of them, and bounded snapshots of the
per-user counters. ``OutputRatePolicy`` (``policy.py``) inherits them; they
read the policy's limiter (and through it a shared store's state), fair
shares and statistics, and a change makes the step's shortcuts forget what
they kept (``shortcuts.py``): a kept batch's ranking may change with it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Collection
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm_output_rate.budget import Budget
from vllm_output_rate.config import (
    DEFAULT_KEY,
    USERS_KEY,
    OutputRateSettings,
)
from vllm_output_rate.fair_settings import (
    FLOORS_KEY,
    WEIGHTS_KEY,
    check_floors,
)
from vllm_output_rate.limits_update import PROMPT_OFF, parse_limits_update
from vllm_output_rate.prompt_limits import DEFAULT_PROMPT_KEY, PROMPT_USERS_KEY
from vllm_output_rate.scheduling.fair_share import FairShare
from vllm_output_rate.scheduling.metric_labels import OTHER_USERS
from vllm_output_rate.scheduling.stats import OutputRateStats
from vllm_output_rate.team_budget import TeamBudget
from vllm_output_rate.teams import Teams, changed_teams, check_team_floors
from vllm_output_rate.validation import OutputRateConfigError

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.shortcuts import StepLayers

# The metrics label of the default limit.
DEFAULT_LABEL = "__default__"


class OperatorView:
    # Set by OutputRatePolicy.
    settings: OutputRateSettings
    limiter: Budget
    prompt_limiter: Budget | None  # prompt tokens computed; None: not limited
    teams: Teams | None  # teams over users; None: none
    fair: FairShare
    stats: OutputRateStats
    shortcuts: StepLayers
    _logger: logging.Logger

    def limits(self) -> dict[str, Any]:
        """Every limit, weight and floor in force (a limits document)."""
        document: dict[str, Any] = self.limits_page(None)["limits"]
        return document

    def limits_page(
        self,
        limit: int | None,
        after: str | None = None,
        extra_users: Collection[str] = (),
    ) -> dict[str, Any]:
        """The limits document of up to ``limit`` users (all: None) with a
        limit, weight or floor of their own (or among ``extra_users``: those
        with admission caps of their own), in name order after the name
        ``after``; with the cursor of the next page (None at the end), the
        page's names and the number of such users. A page is a valid body
        for a change."""
        limiter, fair, prompt = self.limiter, self.fair, self.prompt_limiter
        for budget in (limiter, prompt):
            if budget is not None:
                budget.apply_pending()  # an idle engine takes no steps
        rates, weights, floors = limiter.user_rates, fair.weights, fair.floors
        prompt_rates = prompt.user_rates if prompt is not None else {}
        names = sorted(
            rates.keys()
            | weights.keys()
            | floors.keys()
            | prompt_rates.keys()
            | set(extra_users)
        )
        start = 0 if after is None else bisect.bisect_right(names, after)
        end = len(names) if limit is None else start + limit
        page = names[start:end]
        document = {
            DEFAULT_KEY: limiter.default_rate,
            USERS_KEY: {u: rates[u] for u in page if u in rates},
            WEIGHTS_KEY: {u: weights[u] for u in page if u in weights},
            FLOORS_KEY: {u: floors[u] for u in page if u in floors},
        }
        if prompt is not None:
            document[DEFAULT_PROMPT_KEY] = prompt.default_rate
            document[PROMPT_USERS_KEY] = {
                u: prompt_rates[u] for u in page if u in prompt_rates
            }
        teams = self.current_teams()
        if teams is not None:
            document.update(teams.to_config())
        return {
            "limits": document,
            "next": page[-1] if page and end < len(names) else None,
            "names": page,
            "total": len(names),
        }

    def update_limits(self, payload: object) -> None:
        """Apply an admin change from the next step on; all or nothing."""
        update = parse_limits_update(payload)
        limiter, fair, prompt = self.limiter, self.fair, self.prompt_limiter
        if update.changes_prompt_rates and prompt is None:
            raise OutputRateConfigError(PROMPT_OFF)
        removed = set(update.remove_users)
        floors = {u: f for u, f in fair.floors.items() if u not in removed}
        floors.update(update.user_floors)
        default = update.default_rate or limiter.default_rate

        def ceiling_of(user: str) -> float:
            if user in update.user_rates:
                return update.user_rates[user]
            if user in removed:
                return default
            rate = limiter.user_rates.get(user)
            return default if rate is None else rate

        check_floors(floors, ceiling_of, self.settings.engine_capacity, FLOORS_KEY)
        teams = self.current_teams()
        if update.changes_teams:
            teams = changed_teams(teams, update.teams, update.remove_teams)
        check_team_floors(teams, floors, self.settings.engine_capacity)
        limiter.update_rates(
            default_rate=update.default_rate,
            user_rates=update.user_rates,
            remove_users=update.remove_users,
        )
        if prompt is not None:
            prompt.update_rates(
                default_rate=update.prompt_default,
                user_rates=update.prompt_users,
                remove_users=update.remove_users,
            )
        fair.update(update.user_weights, update.user_floors, update.remove_users)
        if update.changes_teams and teams is not None:
            self.use_teams(teams)
        self.shortcuts.forget()
        self._logger.info("Output rate limits changed: %s", self.limits_summary())

    def current_teams(self) -> Teams | None:
        """The teams in force: their limits and members as the budget holds
        them now (with a shared store, another engine may have changed
        them), their weights and floors as configured here."""
        if isinstance(self.limiter, TeamBudget) and self.teams is not None:
            held = self.limiter.current_teams()
            return replace(self.teams, rates=held.rates, team_of=held.team_of)
        return self.teams

    def use_teams(self, teams: Teams) -> None:
        """Charge members to ``teams`` from the next step on: the policy's
        (``policy.py``), which owns the budget."""
        raise NotImplementedError

    def limits_summary(self) -> str:
        """The limits for a log line: the table itself only while it is short
        (a million users would make a 25 MB line)."""
        rates = self.limiter.user_rates
        users = rates if len(rates) <= 10 else f"{len(rates):,} users"
        summary = f"default {self.limiter.default_rate:g} tok/s, per user {users}"
        if (prompt := self.prompt_limiter) is not None:
            rates = prompt.user_rates
            users = rates if len(rates) <= 10 else f"{len(rates):,} users"
            summary += (
                f"; prompt tokens: default {prompt.default_rate:g} tok/s, "
                f"per user {users}"
            )
        return summary

    def metrics_snapshot(self) -> dict[str, Any]:
        """Per-label counters and each label's limit (bounded in size)."""
        labels = self.stats.snapshot()
        limiter = self.limiter
        limits = {DEFAULT_LABEL: limiter.default_rate}
        for label in labels:
            if label != OTHER_USERS:
                limits[label] = limiter.rate_of(label)
        fair = self.fair
        shares = {
            label: fair.snapshot(label) for label in labels if label != OTHER_USERS
        }
        snapshot = {"labels": labels, "limits": limits, "fair_shares": shares}
        if (prompt := self.prompt_limiter) is not None:
            snapshot["prompt_limits"] = {DEFAULT_LABEL: prompt.default_rate} | {
                label: prompt.rate_of(label) for label in labels if label != OTHER_USERS
            }
        if isinstance(limiter, TeamBudget):
            snapshot["teams"] = limiter.teams_snapshot()
        return self._with_store(snapshot)

    def users_snapshot(self, limit: int, after: str | None = None) -> dict[str, Any]:
        """One page of every user on record, with its limit (see
        ``OutputRateStats.users_page``)."""
        now_ns = self.limiter.now_ns()
        users, cursor, total = self.stats.users_page(now_ns, limit, after)
        prompt = self.prompt_limiter
        teams = self.current_teams()
        team_of = teams.team_of if teams is not None else {}
        for user, view in users.items():
            view["limit"] = self.limiter.rate_of(user)
            if prompt is not None:
                view["prompt_limit"] = prompt.rate_of(user)
            if team_of:
                view["team"] = team_of.get(user)
            view.update(self.fair.snapshot(user))
        page = {
            "time_s": now_ns / 1e9,
            "default_limit": self.limiter.default_rate,
            "users": users,
            "next": cursor,
            "total": total,
        }
        if prompt is not None:
            page["default_prompt_limit"] = prompt.default_rate
        if isinstance(self.limiter, TeamBudget):
            page["teams"] = self.limiter.teams_snapshot()
        return self._with_store(page)

    def _with_store(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        """``snapshot`` plus the shared store's state, when there is one
        (``prompt_store``: the prompt-token budget's leases; ``team_store``:
        the teams')."""
        for key, budget in (
            ("store", self.limiter),
            ("prompt_store", self.prompt_limiter),
        ):
            if budget is None:
                continue
            budget.apply_pending()  # an idle engine takes no steps
            store = budget.store_snapshot()
            if store is not None:
                snapshot[key] = store
        if isinstance(self.limiter, TeamBudget):
            teams = self.limiter.team_store_snapshot()
            if teams is not None:
                snapshot["team_store"] = teams
        return snapshot
