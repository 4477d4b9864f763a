"""One step's prompt-token accounts, for users with a prompt rate (no vLLM import).

``prompt_limits.py`` gives each user a GCRA budget of prompt tokens
computed per second (a limiter of its own, in prompt tokens). A step where
prompt work is possible (``OutputRatePolicy._prompt_step``) reserves, per
user, up to the prompt tokens its requests could compute in it
(``prompt_demand``: the running requests' prompt left, and the waiting
requests' whole prompts), in one limiter call (``StepBudget``):

* every user got all it could use (``cuts`` false): vLLM sizes the chunks
  as ever, and settling charges what was computed;
* a user that got less than ``MIN_PROMPT_CHUNK`` (or its whole prompt
  work, or what its rate grants at once, if less) gives it back and waits
  until its rate allows that much:
  fewer, larger chunks, since every step costs the engine its overhead;
* someone got less: the step runs on the reference path, where
  ``Step.on_chunk`` cuts each chunk's prompt part to what is left of its
  user's reservation (``prompt_part``) and ``Step.admit_waiting`` keeps a
  user's waiting requests queued once nothing is left.

Settling (``PromptStep.settle``) charges the prompt tokens vLLM actually
dispatched and gives back the rest. A chunk that cannot be cut (an image
that must not be split) runs whole, and its excess is charged after the
fact as far as the limiter allows. The bound: docs/architecture.md,
"Prompt-token rates".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING

from vllm_output_rate.budget import Budget
from vllm_output_rate.scheduling.demand import USER_ATTR, user_of
from vllm_output_rate.scheduling.step_budget import StepBudget

if TYPE_CHECKING:
    from vllm.v1.request import Request

_counted = attrgetter(USER_ATTR, "num_tokens", "num_computed_tokens")
# The fewest prompt tokens a user computes in a step (or its whole prompt
# work, if less): below that it waits for its rate to allow more.
MIN_PROMPT_CHUNK = 64


def prompt_demand(
    running: Iterable[Request], waiting: Iterable[Request]
) -> tuple[Counter[str], Counter[str]]:
    """Per user, the prompt tokens its requests could compute next: every
    known token but the last one not computed yet (a prompt, or a preempted
    request's prompt and output to recompute); and its running requests."""
    demand: Counter[str] = Counter()
    residents: Counter[str] = Counter()
    for request in running:
        user, tokens, computed = _counted(request)
        residents[user] += 1
        if tokens - 1 > computed:
            demand[user] += tokens - 1 - computed
    for request in waiting:
        user, tokens, computed = _counted(request)
        if tokens - 1 > computed:
            demand[user] += tokens - 1 - computed
    return demand, residents


def prompt_part(request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
    """The prompt tokens in a chunk: the positions before its request's last
    known token (the one that samples is not one)."""
    last: int = request.num_tokens - 1
    return max(0, min(num_computed_tokens + num_new_tokens, last) - num_computed_tokens)


def computed_prompt_tokens(
    scheduled: Mapping[str, int], requests: Mapping[str, Request]
) -> Counter[str]:
    """Prompt tokens computed per user in a step vLLM scheduled
    (``scheduled``: tokens per request id; ``requests``: vLLM's, whose
    ``num_computed_tokens`` already count the step): each chunk's tokens
    before its request's last known token (prefill and recomputation)."""
    counts: Counter[str] = Counter()
    for request_id, count in scheduled.items():
        request = requests.get(request_id)
        if request is None:
            continue
        prompt = prompt_part(request, request.num_computed_tokens - count, count)
        if prompt:
            counts[user_of(request)] += prompt
    return counts


class PromptStep:
    """One step's prompt-token reservation: made at the start, settled at
    the end (``settle``)."""

    def __init__(
        self,
        limiter: Budget,
        demand: Mapping[str, int],
        residents: Mapping[str, int],
        max_tokens: int,
    ) -> None:
        self.limiter = limiter
        self.budget = budget = StepBudget(limiter, demand, max_tokens)
        self.residents = residents
        # A user that got less than a chunk's worth waits for more, rather
        # than computing a few tokens a step (every step costs the engine
        # its fixed overhead, and the other users their time).
        # (Never more than the user's rate can grant at once: a slow rate's
        # burst holds fewer than a chunk.)
        self.wanted = {
            user: min(count, MIN_PROMPT_CHUNK, limiter.tokens_within(user, 0))
            for user, count in demand.items()
        }
        short = [
            user
            for user, count in budget.reserved.items()
            if count < self.wanted.get(user, 0)
        ]
        if short:
            budget.withdraw(short)
        # Somebody got less than it could compute: the step cuts chunks.
        self.cuts = not budget.covers_demand

    def cap(self, needs: Mapping[str, int]) -> dict[str, int]:
        """A step's token needs (``token_shares.py``) no larger than what each
        user may compute: its prompt reservation, and a token for each of its
        running requests; users left with none dropped."""
        reserved, residents = self.budget.reserved, self.residents
        capped = {
            user: min(need, reserved.get(user, need) + residents.get(user, 0))
            for user, need in needs.items()
        }
        return {user: need for user, need in capped.items() if need > 0}

    def left(self, user: str) -> int:
        """The prompt tokens ``user`` may still compute in this step."""
        return self.budget.remaining(user)

    def use(self, user: str, count: int) -> None:
        """A chunk of ``count`` prompt tokens was let through (cutting steps)."""
        self.budget.spend(user, min(count, self.budget.remaining(user)))

    def settle(self, computed: Mapping[str, int]) -> int | None:
        """Charge the prompt tokens ``computed`` per user in the step, give
        back the rest; the earliest clock reading at which a user refused
        in the step may compute again (None: nobody was refused)."""
        budget = self.budget
        if not self.cuts:
            budget.spend_counts(computed)  # within what each user reserved
            return budget.settle({})
        spent = budget.kept({})
        undispatched = {}
        for user in spent.keys() | computed.keys():
            let_through, done = spent.get(user, 0), computed.get(user, 0)
            if let_through > done:
                undispatched[user] = let_through - done
            elif done > let_through:  # a chunk that could not be cut
                self.limiter.take_up_to(user, done - let_through)
        if budget.settle(undispatched) is None:
            return None
        # When the first refused user has a chunk's worth (GCRA: one token at
        # ready_at_ns, one more every 1 / rate).
        limiter = self.limiter
        return min(
            limiter.ready_at_ns(user)
            + int(max(self.wanted.get(user, 1) - 1, 0) * 1e9 / limiter.rate_of(user))
            for user in budget.refused_users
        )
