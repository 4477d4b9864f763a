"""One scheduler step as a value, and the rules vLLM's per-request hooks apply.

``OutputRatePolicy.begin_step`` makes a ``Step``: the step's reservation
(``budget``), its ``mode`` and everything the step's rules write while vLLM's
``schedule()`` runs. Nothing in it outlives the step; ``settling.settle``
reads it as a unit. The mode (``StepMode``) says what the step does to
vLLM's lists: ``UNCONTESTED``, nobody can be refused and vLLM's order
stands; ``CONTESTED``, resident slots and KV blocks go to users with budget
and the running list is ordered (``planning.py``); ``KEPT``, a contested step
that serves the last ranking's batch again (a shortcut, ``shortcuts.py``).

While vLLM schedules, ``on_chunk`` (its ``_reserve_prefill_lookahead``)
charges, holds back or skips each chunk, and ``admit_waiting`` (its
``_handle_blocked_waiting_request``) decides whether a waiting request may
be tried. ``undo`` puts back what the step changed of vLLM's scheduler for
its duration. The rules, walked through: docs/architecture.md, "The
reference step".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.scheduling import kv_room
from vllm_output_rate.scheduling.demand import user_of
from vllm_output_rate.scheduling.prompt_budget import PromptStep, prompt_part
from vllm_output_rate.seams import num_free_kv_blocks

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_output_rate.scheduling.accounting import Accounting
    from vllm_output_rate.scheduling.engine_modes import EngineModes
    from vllm_output_rate.scheduling.ordering import SharedSlots
    from vllm_output_rate.scheduling.step_budget import StepBudget
    from vllm_output_rate.scheduling.step_slots import StepSlots
    from vllm_output_rate.seams import SchedulerHost


class StepMode(Enum):
    UNCONTESTED = "uncontested"
    CONTESTED = "contested"
    KEPT = "kept"


@dataclass(frozen=True)
class StepRules:
    """What the per-request rules read that outlives a step."""

    host: SchedulerHost
    accounting: Accounting
    modes: EngineModes
    chunked_prefill: bool


@dataclass(eq=False, slots=True)
class Step:
    number: int
    mode: StepMode
    budget: StepBudget
    rules: StepRules
    # --max-num-active-seqs, and the active slots running requests may fill.
    active_cap: int
    running_cap: int
    # A shortcut's step: vLLM's own hook stands in for ours, and the step's
    # tokens are charged from its output (``shortcuts.py``).
    vllm_hook: bool = False
    # Requests our hook charged (request id -> request).
    charged: dict[str, Request] = field(default_factory=dict)
    # Running requests given an active slot.
    active: int = 0
    # Resident requests skipped for lack of budget.
    throttled: list[Request] = field(default_factory=list)
    # Users with a running request left without an active slot, or cut
    # short by their share of the step's tokens.
    deferred_users: set[str] = field(default_factory=set)
    # Each user's tokens left of the step's budget, when the users' work
    # exceeds it (``token_shares.py``); None: vLLM sizes every chunk.
    token_shares: dict[str, int] | None = None
    # Prompt-token accounts, for users with a prompt rate (``prompt_budget.py``).
    prompt: PromptStep | None = None
    # Residency accounts (a contested step in which requests wait).
    slots: StepSlots | None = None
    # vLLM's waiting scan is closed for the step, or will be once the slots
    # granted to waiting requests are taken (a shortcut's).
    admission_closed: bool = False
    close_after_grants: bool = False
    # How a contested step handed out its active slots (ordering.share_slots),
    # and whether the rotations ranked it (a shortcut, rotations.py).
    ranking: SharedSlots[Request] | None = None
    rotated: bool = False
    # Claimants a kept step left waiting (its batch's ranking's).
    kept_waiting_users: frozenset[str] | None = None
    # Running requests off vLLM's list for the step (a shortcut's), put back
    # after the first ``batch`` (the running requests vLLM's step saw), and
    # how many vLLM admitted behind those.
    set_aside: list[Request] = field(default_factory=list)
    batch: int = 0
    admitted: int = 0
    # Arrival times changed for the step (priority scheduling).
    moved_arrivals: dict[Request, float] = field(default_factory=dict)
    # What vLLM scheduled, and the clock when it had.
    output: SchedulerOutput | None = None
    end_ns: int = 0

    # ----- vLLM's per-request hooks ---------------------------------------

    def on_chunk(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """Charge, hold back or skip the chunk vLLM sized for ``request``.

        Returns the tokens to compute for it in this step (0: skip it).
        """
        if num_new_tokens <= 0:
            return num_new_tokens
        in_running_loop = request.status == RequestStatus.RUNNING
        user = user_of(request)
        end = request.num_tokens + request.num_output_placeholders
        shares = self.token_shares
        if shares is not None and num_new_tokens > shares.get(user, 0):
            self.deferred_users.add(user)  # cut short: backlogged in the step
            num_new_tokens = self._cut(
                request,
                num_computed_tokens,
                num_new_tokens,
                end,
                in_running_loop,
                shares.get(user, 0),
            )
            if not num_new_tokens:
                return 0
        prompt = self.prompt
        if prompt is not None and prompt.cuts:
            num_new_tokens = self._within_prompt_rate(
                prompt,
                request,
                num_computed_tokens,
                num_new_tokens,
                end,
                in_running_loop,
            )
            if not num_new_tokens:
                return 0
        samples = (
            num_computed_tokens + num_new_tokens >= end
            and request.request_id not in self.charged  # never charge twice
        )
        budget = self.budget
        if samples and not budget.has_budget(user):
            # No budget: compute the prompt up to the sampling position only.
            rules = self.rules
            held_back = rules.modes.hold_back_end(request, end) - num_computed_tokens
            if not (rules.chunked_prefill and held_back > 0):
                if in_running_loop:
                    # Skipped: it keeps its KV blocks and worker slot but
                    # gives its active slot to a waiting request.
                    self.throttled.append(request)
                    self._raise_admission_cap()
                return 0
            samples = False
            num_new_tokens = min(num_new_tokens, held_back)
        if in_running_loop:
            if self.active >= self.running_cap:
                # Deferred: no active slot left for it in this step. Like a
                # throttled request, it does not count as active for the
                # admission of waiting requests.
                self.deferred_users.add(user)
                self._raise_admission_cap()
                return 0
            self.active += 1
        if samples:
            # The most it can emit (with drafts: trimmed to the budget).
            num_new_tokens, count = self.rules.accounting.charge(
                request,
                num_new_tokens - (end - num_computed_tokens),
                num_new_tokens,
                in_running_loop,
                budget.remaining(user),
            )
            budget.spend(user, count)
            self.charged[request.request_id] = request
        if shares is not None:
            shares[user] = shares.get(user, 0) - num_new_tokens
        return num_new_tokens

    def _cut(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        end: int,
        in_running_loop: bool,
        left: int,
    ) -> int:
        """The chunk trimmed to ``left`` tokens (0: none of it runs). It stops
        where a prefill may stop without sampling
        (``EngineModes.hold_back_end``), or keeps its sampling position and
        fewer draft tokens; it is not cut where an image must not be split
        (``EngineModes.may_cut``). A waiting request's chunk that cannot stop
        inside ``left`` runs whole: vLLM ends its waiting scan at a chunk of
        0 tokens."""
        modes = self.rules.modes
        if left > 0 and modes.may_cut(
            request, num_computed_tokens, num_computed_tokens + num_new_tokens
        ):
            limit = num_computed_tokens + left
            if limit >= end:
                return left
            stop = modes.hold_back_end(request, end, limit)
            if stop > num_computed_tokens:
                return stop - num_computed_tokens
        if not in_running_loop:
            return num_new_tokens
        self._raise_admission_cap()
        return 0

    def _within_prompt_rate(
        self,
        prompt: PromptStep,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        end: int,
        in_running_loop: bool,
    ) -> int:
        """The chunk with no more prompt tokens than its user has left of
        its prompt rate in the step (``prompt_budget.py``); those are used."""
        user = user_of(request)
        part = prompt_part(request, num_computed_tokens, num_new_tokens)
        if not part:
            return num_new_tokens
        left = prompt.left(user)
        if part > left:
            # Only prompt tokens go: the cut stops before the sampling position.
            num_new_tokens = self._cut(
                request,
                num_computed_tokens,
                num_new_tokens,
                end,
                in_running_loop,
                left,
            )
            part = prompt_part(request, num_computed_tokens, num_new_tokens)
        prompt.use(user, part)
        return num_new_tokens

    def _raise_admission_cap(self) -> None:
        """Let a resident request that is skipped in this step not count.

        vLLM admits a waiting request while ``len(running)`` is below
        ``max_num_active_reqs``; each skipped resident request raises that
        bar by one, never beyond ``--max-num-seqs`` (the worker slots).
        """
        if self.admission_closed:
            return
        host = self.rules.host
        host.max_num_active_reqs = min(
            host.max_num_running_reqs, host.max_num_active_reqs + 1
        )

    def admit_waiting(self, request: Request) -> bool:
        """Whether vLLM may try to admit this waiting request now."""
        rules = self.rules
        if not rules.modes.adapter_fits(request, self.number, rules.host.running):
            return False
        user = user_of(request)
        shares = self.token_shares
        if shares is not None and shares.get(user, 0) <= 0:
            self.deferred_users.add(user)
            return False  # its user's share of the step's tokens is spent
        prompt = self.prompt
        if prompt is not None and prompt.cuts and not prompt.left(user):
            return False  # its user's prompt rate is spent for now
        slots = self.slots
        if slots is not None and request.request_id in slots.preempted_ids:
            return False  # never resumed in the step that preempted it
        if self.budget.has_budget(user):
            # Slots taken back for claimants are theirs.
            admit = slots is None or slots.may_take_a_slot(user)
        elif slots is not None and not slots.may_prefill_ahead(user):
            return False  # its place is for users with budget (residency rule 2)
        else:
            admit = self._may_prefill_ahead(request)
        if admit and slots is not None:
            slots.admitted(user)
            if self.close_after_grants and not slots.grants_left():
                self.close_admission()
        return admit

    def _may_prefill_ahead(self, request: Request) -> bool:
        # The user has no budget, so this request could at most prefill up to
        # its sampling position. Leave it in the queue (skipped, order kept)
        # whenever admitting it could stop vLLM's scan for everyone behind
        # it, or would only repeat work:
        # - its first chunk may have to sample (nothing to prefill ahead);
        # - it was preempted for KV space, which it would take again just to
        #   wait;
        # - its prompt does not fit in the free KV blocks (vLLM ends the scan
        #   at a failed allocation).
        host = self.rules.host
        return not (
            self.rules.modes.may_only_run_by_sampling(request)
            or request.status == RequestStatus.PREEMPTED
            or kv_room.blocks_for(host, request.num_tokens) > num_free_kv_blocks(host)
        )

    # ----- the step's temporary changes -----------------------------------

    def close_admission(self) -> None:
        """End vLLM's waiting scan at once: nobody waiting may be admitted."""
        self.rules.host.max_num_active_reqs = 0
        self.admission_closed = True

    def move_arrivals_last(self, requests: list[Request]) -> None:
        """Make ``requests`` look newest for the step (priority scheduling
        preempts the request with the largest ``(priority, arrival_time)``)."""
        for request in requests:
            self.moved_arrivals[request] = request.arrival_time
            request.arrival_time = math.inf

    def undo(self) -> None:
        """Put back what the step changed of vLLM's scheduler (also when
        vLLM's step raised)."""
        host = self.rules.host
        host.max_num_active_reqs = self.active_cap
        if self.set_aside:
            # Where they were: behind the batch, ahead of the admissions.
            running, batch = host.running, self.batch
            self.admitted = max(0, len(running) - batch)
            running[batch:batch] = self.set_aside
        if self.moved_arrivals:
            self._restore_arrivals()

    def _restore_arrivals(self) -> None:
        preempted = []
        for request, arrival_time in self.moved_arrivals.items():
            request.arrival_time = arrival_time
            if request.status == RequestStatus.PREEMPTED:
                preempted.append(request)
        if preempted:
            # They entered the waiting heap with the temporary key; re-insert
            # them with the real one.
            waiting = self.rules.host.waiting
            waiting.remove_requests(preempted)
            for request in preempted:
                waiting.add_request(request)

    def claimants_left_waiting(self) -> frozenset[str] | list[str] | None:
        """Users that wanted a resident slot and were left waiting; None when
        the step did not look (no residency accounts, not a kept step)."""
        if self.slots is not None and self.slots.wanted:
            return self.slots.left_waiting()
        return self.kept_waiting_users
