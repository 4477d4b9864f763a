"""Each user's share of one step's token budget (no vLLM import).

vLLM computes at most ``--max-num-batched-tokens`` tokens in a step. It
serves its running list in order, each chunk as large as the budget left,
and tries waiting requests only while budget is left: one user with long
prompts takes every step, and another user's short request waits behind
them. When the users' work in a step exceeds the budget, the step shares it:

* ``step_needs``: what each user would compute in the step: the next
  chunks of its running requests that take an active slot (without the
  sampling position beyond what the user may sample in the step), and the
  prompts of the waiting requests that the free active and resident slots
  and KV blocks could admit (per user with budget, as many as the ranking
  granted it, else at most as many as slots are free);
* ``share_tokens``: the budget goes to the users in order, each getting
  all it needs (the last one the rest): as ``fair_share.FairShare.ranks``
  orders them (users with budget first, below their floor, then least
  weighted service in whole prefill turns), then the least work per
  weight, then the order of vLLM's lists. The shares add up to the whole
  budget: nothing is left unused unless a user computes less than counted
  (a prefix-cache hit, a request that finds no resident slot or KV blocks).

The step then trims each chunk to what is left of its user's share and keeps
a user's waiting requests queued when nothing is left (``step.Step``). The
rule and its bound: docs/architecture.md, "A fair share of each step's
tokens".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter, truediv
from typing import TYPE_CHECKING

from vllm_output_rate.scheduling.demand import USER_ATTR

if TYPE_CHECKING:
    from vllm.v1.request import Request

_counted = attrgetter(
    "num_output_placeholders",
    "num_computed_tokens",
    "num_tokens_with_spec",
    USER_ATTR,
    "num_prompt_tokens",
    "max_tokens",
)
_waiting = attrgetter(USER_ATTR, "num_tokens", "num_computed_tokens")


def step_needs(
    running: Iterable[Request],
    waiting: Iterable[Request],
    *,
    running_slots: int,
    active_slots: int,
    resident_slots: int,
    kv_tokens: int,
    budget: int,
    allowance: Mapping[str, int],
    granted: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Tokens each user would compute in the step: the running requests in
    list order until ``running_slots`` of them have work, then, while their
    chunks fit in ``kv_tokens``, per user at most as many waiting requests
    as slots are left (of ``active_slots``, and free of ``resident_slots``;
    or as many as the ranking ``granted`` it) if it has ``allowance``
    (tokens it may sample in the step) left. A
    request that would sample beyond its user's allowance counts without its
    sampling position. Each count is at most ``budget``: no chunk is
    larger."""
    needs: dict[str, int] = {}
    left = dict(allowance)
    used = 0
    # One C call per request for what the count reads.
    for placeholders, computed, with_spec, user, prompt, max_tokens in map(
        _counted, running
    ):
        if used >= running_slots:
            break
        if placeholders and computed + 2 - placeholders >= prompt + max_tokens:
            continue  # its last token is in flight: vLLM passes over it
        count = with_spec + placeholders - computed
        if count > budget:
            count = budget  # a chunk that stops short: it does not sample
        elif left.get(user, 1) > 0:
            left[user] = left.get(user, 1) - 1
        else:
            count -= 1  # held back short of its sampling position
        if count > 0:
            needs[user] = needs.get(user, 0) + count
            used += 1
    free_slots = min(active_slots - used, resident_slots)
    if free_slots > 0 and kv_tokens > 0:
        admissible: dict[str, int] = {}
        get = needs.get
        for user, count, computed in map(_waiting, waiting):
            taken = admissible.get(user, 0)
            most = free_slots if granted is None else granted.get(user, 0)
            if taken < most and left.get(user, 1) > 0:
                admissible[user] = taken + 1
                count -= computed
                if count > 0:
                    count = count if count < budget else budget
                    needs[user] = get(user, 0) + count
                    kv_tokens -= count
                    if kv_tokens <= 0:
                        break
    return needs


def share_tokens(
    needs: Mapping[str, int],
    budget: int,
    ranks: Callable[[list[str]], Iterable[tuple[float, ...]]],
    weights: Callable[[list[str]], Iterable[float]],
) -> dict[str, int] | None:
    """Each user's tokens of the step's ``budget``; None when the needs fit
    in it (nobody needs a share). ``ranks`` and ``weights`` give those of a
    list of users, in its order. Full ties go in the order of ``needs``."""
    if sum(needs.values()) <= budget:
        return None
    users = list(needs)
    # Full ties go in the order of ``needs`` (vLLM's: running, then queue),
    # so that vLLM's loops meet the users with a share first.
    order = sorted(
        zip(
            ranks(users),
            map(truediv, map(needs.__getitem__, users), weights(users)),
            range(len(users)),
            users,
            strict=False,
        )
    )
    shares = dict.fromkeys(users, 0)
    for _, _, _, user in order:
        share = shares[user] = min(needs[user], budget)
        budget -= share
        if not budget:
            break
    return shares
