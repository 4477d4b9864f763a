"""One scheduler step's accounts against the limiter (no vLLM import).

At the start of a step every user with unfinished requests gets a
reservation from one limiter call (``take_many``), sized to what the user
could sample at most in the step: one token per unfinished request (one
plus the draft tokens with speculative decoding). Each sampling request then
spends its tokens of it with a dictionary update (or the scheduler spends a
whole step's count at once, ``spend_counts``). At the end of the step,
everything reserved but not dispatched goes back in one ``refund_many``
call. While every user is far below its limit, the limiter absorbs those
refunds (they change nothing a later call can see), so that the next step's
same reservation is renewed in O(1).

This is exactly equivalent to one ``try_take`` per sampled token at the
step's clock reading, but the limiter's work grows with the number of users,
not with the number of resident requests, and a user refused once is not
asked again in the same step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from operator import itemgetter

from vllm_output_rate.budget import Budget


class StepBudget:
    """One step's reservation: made at the start of the step, settled at its end."""

    def __init__(
        self, limiter: Budget, demand: Mapping[str, int], max_tokens_per_step: int
    ) -> None:
        """Reserve each user's allowance for the step, up to its ``demand``:
        the most tokens its unfinished requests could sample in the step. No
        user can sample more than ``max_tokens_per_step`` (requests
        scheduled in a step, times the tokens each can emit)."""
        self.limiter = limiter
        self._max_tokens_per_step = max_tokens_per_step
        if demand and max(demand.values()) > max_tokens_per_step:
            demand = {
                user: min(count, max_tokens_per_step) for user, count in demand.items()
            }
        # user -> tokens reserved this step, and reserved and not yet spent.
        self._reserved: dict[str, int] = limiter.take_many(demand)
        self._remaining: dict[str, int] = dict(self._reserved)
        # Whether every user got all it asked for: nobody can be refused.
        self.covers_demand = self._reserved == demand
        # The time the step's tokens were admitted (the dispatch log's stamp).
        self.taken_ns = limiter.last_take_ns
        self.refused_users: set[str] = set()

    @property
    def reserved(self) -> Mapping[str, int]:
        """Tokens reserved per user for this step (read-only view)."""
        return self._reserved

    def withdraw(self, users: Iterable[str]) -> None:
        """Give ``users``' reservations back now: they are refused for the
        step (a caller that wants no tokens rather than too few)."""
        refunds = {user: self._reserved[user] for user in users}
        self.limiter.refund_many(refunds)
        for user in refunds:
            self._reserved[user] = self._remaining[user] = 0
            self.refused_users.add(user)
        self.covers_demand = False

    def has_budget(self, user: str) -> bool:
        """Whether ``user`` can still sample a token in this step."""
        return self.remaining(user) > 0

    def remaining(self, user: str) -> int:
        """Tokens ``user`` can still be charged in this step (0: refused)."""
        remaining = self._remaining.get(user)
        if remaining is None:
            # Not in the step's demand (the caller's count missed it): ask
            # now, as the reservation would have.
            remaining = self.limiter.take_up_to(user, self._max_tokens_per_step)
            self._reserved[user] = self._remaining[user] = remaining
        if not remaining:
            self.refused_users.add(user)
        return remaining

    def spend(self, user: str, count: int = 1) -> bool:
        """Spend ``count`` tokens of ``user``'s allowance; False (refused,
        nothing spent) if fewer are left."""
        if self.remaining(user) < count:
            return False
        self._remaining[user] -= count
        return True

    def spend_counts(self, sampled: Mapping[str, int]) -> bool:
        """Spend a whole step's tokens per user, when every user was covered.

        In the common steady state (everyone sampled what it reserved) this
        is one dictionary comparison. Returns False if some user sampled
        more than it reserved (the demand was not an upper bound: a bug); the
        excess is then taken from the limiter after the fact, as far as the
        limiter allows, rather than failing the engine.
        """
        if sampled == self._reserved:
            self._remaining = dict.fromkeys(self._reserved, 0)
            return True
        remaining = self._remaining
        exact = True
        for user, count in sampled.items():
            left = remaining.get(user, 0) - count
            if left < 0:
                exact = False
                self.limiter.take_up_to(user, -left)
                left = 0
            remaining[user] = left
            self._reserved.setdefault(user, 0)
        return exact

    def kept(self, undispatched: Mapping[str, int]) -> dict[str, int]:
        """Per user granted at least one token in this step, the tokens it
        keeps once ``settle(undispatched)`` has given back the rest."""
        remaining = self._remaining
        return {
            user: reserved - min(reserved, remaining[user] + undispatched.get(user, 0))
            for user, reserved in self._reserved.items()
            if reserved
        }

    def settle(self, undispatched: Mapping[str, int]) -> int | None:
        """Return unspent and undispatched tokens to the limiter.

        ``undispatched`` counts, per user, tokens that were spent on requests
        the step did not dispatch after all (KV allocation failed, preempted,
        out of token budget). Returns the earliest clock reading at which a
        user refused in this step may sample again, or None if none was.
        """
        if (undispatched or any(self._remaining.values())) and not (
            # The refunds would change nothing (users far below their
            # limits): skip building them, one per user with tokens left.
            undispatched.keys() <= self._reserved.keys()
            and self.limiter.refunds_absorbed(self._reserved.keys())
        ):
            remaining = self._remaining
            if undispatched:
                refunds = {
                    user: min(unused, reserved)
                    for user, reserved in self._reserved.items()
                    if (unused := remaining[user] + undispatched.get(user, 0))
                }
            else:  # what is left of each reservation (never more than it)
                refunds = dict(filter(itemgetter(1), remaining.items()))
            self.limiter.refund_many(refunds)
        if not self.refused_users:
            return None
        return min(self.limiter.ready_at_ns(user) for user in self.refused_users)
