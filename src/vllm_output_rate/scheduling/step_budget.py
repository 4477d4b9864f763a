"""One scheduler step's accounts against the limiter (no vLLM import).

The first time a user is met in a step, the step reserves that user's whole
allowance with one limiter call (``take_up_to``); each sampling request then
spends one token of it with a dictionary update. At the end of the step,
everything reserved but not dispatched goes back in one ``refund`` per user.
This is exactly equivalent to one ``try_take`` per request at the step's
clock reading, but the limiter's work grows with the number of users met in
the step, not with the number of resident requests, and a user refused once
is not asked again in the same step.
"""

from __future__ import annotations

from collections import Counter

from vllm_output_rate.limiter import OutputRateLimiter


class StepBudget:
    def __init__(self, limiter: OutputRateLimiter, max_tokens_per_step: int) -> None:
        self.limiter = limiter
        # No user can sample more tokens than requests are scheduled in a step.
        self._max_tokens_per_step = max_tokens_per_step
        self._reserved: dict[str, int] = {}  # user -> tokens reserved this step
        self._remaining: dict[str, int] = {}  # user -> reserved and not yet spent
        self.refused_users: set[str] = set()

    def begin_step(self) -> None:
        self._reserved.clear()
        self._remaining.clear()
        self.refused_users.clear()

    def has_budget(self, user: str) -> bool:
        """Whether ``user`` can still sample a token in this step."""
        remaining = self._remaining.get(user)
        if remaining is None:
            remaining = self.limiter.take_up_to(user, self._max_tokens_per_step)
            self._reserved[user] = self._remaining[user] = remaining
        if remaining:
            return True
        self.refused_users.add(user)
        return False

    def spend(self, user: str) -> bool:
        """Spend one token of ``user``'s allowance; False (refused) if none is left."""
        if not self.has_budget(user):
            return False
        self._remaining[user] -= 1
        return True

    def settle(self, undispatched: Counter[str]) -> int | None:
        """Return unspent and undispatched tokens to the limiter.

        ``undispatched`` counts, per user, tokens that were spent on requests
        the step did not dispatch after all (KV allocation failed, preempted,
        out of token budget). Returns the earliest clock reading at which a
        user refused in this step may sample again, or None if none was.
        """
        for user, reserved in self._reserved.items():
            unused = self._remaining[user] + undispatched.get(user, 0)
            if unused:
                self.limiter.refund(user, min(unused, reserved))
        if not self.refused_users:
            return None
        return min(self.limiter.ready_at_ns(user) for user in self.refused_users)
