"""Who is owed service when the engine is the bottleneck (no vLLM import).

Ceilings (the limiter) say how much a user may receive at most;
``FairShare`` says who goes first when active slots, resident slots or a
step's token budget run out while users are below their ceilings. Per user:

* a virtual service counter ``V_u`` (after VTC): output tokens plus
  ``PREFILL_TOKEN_COST`` per prompt token computed, over the user's weight,
  added only for steps that left someone waiting (``charge``) and read no
  lower than the *level*, the lowest counter of the last step's backlogged
  users (``backlogged``): idling earns no credit, plenty earns no debt;
* floor credit, for a user with a floor: earned while it has unfinished
  requests (at most ``FLOOR_BURST_S`` of its floor), spent per output token
  (``credit_floors``); time a whole burst behind is counted.

``key`` ranks a user's ``k``-th slot of a step: a user below its floor ahead
of every counter, then ``V_u + k / w_u``; ``ranks`` orders users for a
step's tokens the same way. Why each rule, the bound it gives
and its proof: docs/architecture.md, "Fair shares when the engine is full".
Cost per step: O(users served + backlogged users), never O(resident requests).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from itertools import repeat
from operator import floordiv, not_

# A request served in the last step keeps its active slot (its turn) while
# its user is within this many tokens (over its weight) of the user owed
# most: every change of the batch costs vLLM's model runner a rebuild of its
# persistent batch (docs/architecture.md, "Turns"). So a request runs on
# while its user keeps the slot, as in stock vLLM, and a slot passes between
# two users only when one is this far ahead. It widens the bound by
# TURN_TOKENS / weight.
TURN_TOKENS = 16
# What one prompt token computed costs, relative to one output token (VTC's
# evaluation weighs input tokens at half an output token). Prefill is paid
# once per request; decoding is what users wait for.
PREFILL_TOKEN_COST = 0.5
# How far ahead of its floor's pace a user's credit may grow (seconds of its
# floor): the floor's burst, like the ceilings' 100 ms.
FLOOR_BURST_S = 0.1
DEFAULT_WEIGHT = 1.0
NS_PER_S = 1_000_000_000
# Longest gap between two steps credited to floors (an idle engine does not
# step: no-one is below its floor because nothing ran).
MAX_CREDIT_GAP_NS = 1_000_000_000


class FairShare:
    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        floors: Mapping[str, float] | None = None,
    ) -> None:
        # As configured; ``_ranked`` is what the ranking reads: these, with
        # team members' weights from their team's over them
        # (``set_member_shares``).
        self.weights: dict[str, float] = dict(weights or {})
        self.floors: dict[str, float] = dict(floors or {})
        self._members: dict[str, float] = {}
        self._ranked: dict[str, float] = dict(self.weights)
        # Floors kept: the configured ones, and team members' parts of their
        # team's floor over them (the larger).
        self._member_floors: dict[str, float] = {}
        self.ranked_floors: dict[str, float] = dict(self.floors)
        # Virtual service per user (tokens / weight), read through service().
        self._service: dict[str, float] = {}
        self.level = 0.0
        self._credit: dict[str, float] = {}
        # Time each floored user spent a whole burst behind its floor.
        self.below_floor_ns: dict[str, int] = {}
        self._last_ns: int | None = None

    # ----- settings -----------------------------------------------------

    def weight(self, user: str) -> float:
        """The weight ``user`` is ranked with."""
        return self._ranked.get(user, DEFAULT_WEIGHT)

    def own_weight(self, user: str) -> float:
        """``user``'s weight as configured (a member's own, in its team)."""
        return self.weights.get(user, DEFAULT_WEIGHT)

    def update(
        self,
        weights: Mapping[str, float] | None = None,
        floors: Mapping[str, float] | None = None,
        remove_users: Collection[str] = (),
    ) -> None:
        """Change weights and floors from the next step on (validated by
        the caller: ``config.parse_fairness``)."""
        for user in remove_users:
            self.weights.pop(user, None)
            self.floors.pop(user, None)
            self._credit.pop(user, None)
        self.weights.update(weights or {})
        self.floors.update(floors or {})
        self._rank_with_members()

    def set_member_shares(
        self, weights: Mapping[str, float], floors: Mapping[str, float]
    ) -> bool:
        """Team members' weights, over their own, and their parts of their
        team's floor (``teams.member_shares``), from the next step on;
        whether they changed."""
        if weights == self._members and floors == self._member_floors:
            return False
        self._members, self._member_floors = dict(weights), dict(floors)
        self._rank_with_members()
        return True

    def _rank_with_members(self) -> None:
        self._ranked = self.weights | self._members
        kept = dict(self.floors)
        for user, floor in self._member_floors.items():
            if floor > kept.get(user, 0.0):
                kept[user] = floor
        self.ranked_floors = kept

    # ----- ranking ------------------------------------------------------

    def service(self, user: str) -> float:
        """``V_u`` as the ranking reads it: never below the level."""
        own = self._service.get(user)
        return self.level if own is None or own < self.level else own

    def services(self, users: Iterable[str]) -> list[float]:
        """``service`` of each of ``users`` (no Python call each)."""
        get, level = self._service.get, self.level
        return [own if (own := get(user, level)) > level else level for user in users]

    def weights_of(self, users: Iterable[str]) -> list[float]:
        """``weight`` of each of ``users`` (no Python call each)."""
        return list(map(self._ranked.get, users, repeat(DEFAULT_WEIGHT)))

    def credit(self, user: str) -> float:
        return self._credit.get(user, 0.0)

    def key(
        self, user: str, k: int, last_served: int, turn_left: int = 0
    ) -> tuple[int, float, int]:
        """The rank of ``user``'s ``k``-th slot in this step (0-based), for a
        request whose turn keeps it on by ``turn_left`` tokens (0: none)."""
        # service() and weight() inline: the ranking and every kept step
        # (kept_batch) call this a few times per step.
        below = self._credit.get(user, 0.0) - k >= 1.0
        level = self.level
        own = self._service.get(user, level)
        return (
            0 if below else 1,
            (own if own > level else level)
            + (k - turn_left) / self._ranked.get(user, DEFAULT_WEIGHT),
            last_served,
        )

    def ranks(
        self, users: list[str], turn: float, allowance: Mapping[str, int]
    ) -> Iterable[tuple[bool, bool, float]]:
        """Who goes first for a step's tokens, per user of ``users``: a user
        with ``allowance`` (tokens it may sample in the step) before one
        without, below its floor, then the least weighted service, counted
        in whole ``turn``s: users within a turn of each other tie
        (``token_shares`` breaks ties by the least work, so a prompt begun
        is finished before the next one of an equal user starts). Built
        without a Python call per user."""
        refused = map(not_, map(allowance.get, users, repeat(1)))
        turns = map(floordiv, self.services(users), repeat(turn))
        credit = self._credit
        if not credit:
            return zip(refused, repeat(True), turns)
        above = (credit.get(user, 0.0) < 1.0 for user in users)
        return zip(refused, above, turns, strict=True)

    # ----- after a step -------------------------------------------------

    def charge(
        self,
        output_tokens: Mapping[str, int],
        prompt_tokens: Mapping[str, int],
    ) -> float:
        """Add a step's service: output tokens and prompt tokens computed.
        Returns a bound on how much one user's counter grew (the largest
        output charge plus the largest prompt charge)."""
        service, level, weights = self._service, self.level, self._ranked
        grown = 0.0
        for counts, cost in ((output_tokens, 1.0), (prompt_tokens, PREFILL_TOKEN_COST)):
            largest = 0.0
            for user, count in counts.items():
                own = service.get(user, level)
                added = cost * count / weights.get(user, DEFAULT_WEIGHT)
                service[user] = (own if own > level else level) + added
                if added > largest:
                    largest = added
            grown += largest
        return grown

    def backlogged(self, users: Collection[str], capped: Collection[str]) -> None:
        """Raise the level to the lowest counter among the users that had a
        runnable request left unserved in the step (none: unchanged). The
        users held back by their own ceiling (``capped``) do not count:
        service a user's limit declined is not owed to it later (and, read
        as at least the level, they start level with the others)."""
        if capped:
            users = [user for user in users if user not in capped]
        if users:
            # min(map(self.service, users)), without a Python call per user:
            # a user without a counter reads as the level.
            level = self.level
            lowest = min(map(self._service.get, users, repeat(level)))
            if lowest > level:
                self.level = lowest

    def credit_floors(
        self,
        now_ns: int,
        unfinished: Mapping[str, int],
        received: Mapping[str, int],
    ) -> None:
        """Floors: credit the time since the last step, spend what was
        received, count time a whole burst behind."""
        last, self._last_ns = self._last_ns, now_ns
        if not self.ranked_floors:
            return
        elapsed = 0 if last is None else min(now_ns - last, MAX_CREDIT_GAP_NS)
        credit = self._credit
        for user, floor in self.ranked_floors.items():
            if not unfinished.get(user):
                credit.pop(user, None)
                continue
            cap = max(1.0, floor * FLOOR_BURST_S)
            earned = credit.get(user, 0.0) + floor * elapsed / NS_PER_S
            if earned >= cap:  # a whole burst behind its floor
                self.below_floor_ns[user] = self.below_floor_ns.get(user, 0) + elapsed
            credit[user] = max(0.0, min(cap, earned) - received.get(user, 0))

    def forget(self, live: Collection[str]) -> None:
        """Drop the counters of users with no unfinished request (memory
        bound): when they come back they start at the level, as they would
        have anyway unless they had been served more than everyone."""
        self._service = {u: v for u, v in self._service.items() if u in live}

    def snapshot(self, user: str) -> dict[str, float]:
        """A user's fair-share state for the stats endpoint."""
        view = {"weight": self.weight(user), "virtual_service": self.service(user)}
        floor = self.ranked_floors.get(user)
        if floor is not None:
            view["floor"] = floor
            view["below_floor_seconds"] = self.below_floor_ns.get(user, 0) / NS_PER_S
        return view
