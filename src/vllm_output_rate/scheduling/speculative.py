"""Speculative decoding's ledger: charge the most a step can emit, give back
what it did not emit (no vLLM import).

At dispatch a sampling chunk is charged the most it can emit: one token plus
its drafts, trimmed first to the user's budget (``fit_drafts``,
``charge_for``). ``SpeculativeLedger`` keeps each step's charges per user
(``record_step``); when vLLM reports the step back, the scheduler's
``update_from_output`` lets it count the tokens each request received
(``before_report``, ``reported``: bookkeeping, never a limiter call, so
asynchronous scheduling keeps working). Before the next step's reservation,
``refunds`` gives back what was charged and not received (rejected drafts,
tokens cut by a stop, a request aborted or finished meanwhile); a step
reported after later steps took budget is refunded with the limiter's
``refund_late``, given the later takes (``note_grants``). Invariant: charges
minus refunds equal the tokens users received, step by step. Why this keeps
the bound, and the cost: docs/architecture.md, "Engine modes". Scheduler
outputs are vLLM's ``SchedulerOutput`` (read: ``num_scheduled_tokens``,
``scheduled_spec_decode_tokens``, ``scheduled_new_reqs``,
``scheduled_cached_reqs.resumed_req_ids``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, KeysView, Mapping
from dataclasses import dataclass, field
from itertools import filterfalse, repeat
from operator import attrgetter, sub
from typing import TYPE_CHECKING

from vllm_output_rate.scheduling.demand import user_of

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_is_prefill_chunk = attrgetter("is_prefill_chunk")
# Request.num_output_tokens is len(_output_token_ids) (a seam fact): read
# the list itself, so the per-request pass makes no Python call.
_output_token_ids = attrgetter("_output_token_ids")
_NO_DRAFTS: tuple[int, ...] = ()


def num_drafts(output: SchedulerOutput) -> int:
    """Draft tokens scheduled in a step (0 without speculative decoding)."""
    drafts = output.scheduled_spec_decode_tokens
    return sum(map(len, drafts.values())) if drafts else 0


def per_user(users: Iterable[str], counts: Iterable[int]) -> dict[str, int]:
    """Sum ``counts`` per user.

    A plain loop: measured faster than a C-level Counter over repeated
    names (the repeat objects cost more than the loop). A plain dict:
    Counter's == is a Python-level method, and the policy compares this
    with the step's reservation."""
    totals: dict[str, int] = {}
    get = totals.get
    for user, count in zip(users, counts):  # noqa: B905 (same lengths)
        totals[user] = get(user, 0) + count
    return totals


@dataclass(slots=True)
class _Step:
    """One step's sampling dispatches, until vLLM reports the step back."""

    output: SchedulerOutput  # held, so that its id() stays unique
    step: int
    time_ns: int
    requests: list[Request]
    users: list[str]
    charged: Mapping[str, int]
    # Every request charged its most (each received at most its charge).
    full: bool = False
    before: list[int] = field(default_factory=list)  # outputs before its report


@dataclass(slots=True)
class Refunds:
    """What users were charged and did not receive: ``plain`` per user
    (nothing was taken for them since: the limiter's ``refund_many``), and
    ``late`` (user, tokens, takes granted since: its ``refund_late``)."""

    plain: dict[str, int] = field(default_factory=dict)
    late: list[tuple[str, int, list[tuple[int, int]]]] = field(default_factory=list)


# A step whose refunds change nothing (callers only read a Refunds).
_NONE_OWED = Refunds()


class SpeculativeLedger:
    def __init__(self, num_spec_tokens: int, *, late_refunds: bool) -> None:
        # Tokens one request can be charged in a step: one plus every draft.
        self.tokens_per_request = 1 + num_spec_tokens
        # Whether a step can be reported after the next one took budget
        # (asynchronous scheduling, pipeline parallelism).
        self._late_refunds = late_refunds
        # Steps dispatched and not reported yet, by their SchedulerOutput.
        self._in_flight: dict[int, _Step] = {}
        # Reported steps with what each user received from them, oldest
        # first, until the next refund point.
        self._reported: list[tuple[_Step, dict[str, int]]] = []
        # user -> [(step, clock_ns, kept)] of the takes granted since the
        # oldest step in flight (late refunds only).
        self._grants: dict[str, list[tuple[int, int, int]]] = {}
        # Charges of this step's requests (request id -> tokens), set by the
        # policy's hook in steps where it runs.
        self.charges: dict[str, int] = {}
        # What the latest refunds() found: tokens received per user, and per
        # (dispatch time, user) for the dispatch log.
        self.delivered: dict[str, int] = {}
        self.delivered_at: list[tuple[int, dict[str, int]]] = []
        # Received more than charged (would be a bug); the policy charges the
        # excess after the fact and logs it.
        self.undercharged: Counter[str] = Counter()
        # most_per_user's last answer, and the count of changes it is for.
        self._most: dict[str, int] = {}
        self._most_changes = -1
        # record_step's last full step: its request ids, requests and their
        # users. Dropped by most_per_user when the unfinished requests
        # change, so the same ids then mean the same requests.
        self._last_full: tuple[list[str], list[Request], list[str]] | None = None

    def most_per_user(
        self, unfinished: Mapping[str, int], changes: int
    ) -> dict[str, int]:
        """The most tokens each user's ``unfinished`` requests can emit in a
        step; ``changes`` counts the changes of ``unfinished`` (the same
        count: the same answer, kept from the last call)."""
        if changes != self._most_changes:
            # Its ids may now name other requests (and it holds finished ones).
            self._last_full = None
            per_request = self.tokens_per_request
            self._most = {user: n * per_request for user, n in unfinished.items()}
            self._most_changes = changes
        return self._most

    def unsettled_steps(self) -> int:
        """Steps in flight, or reported and not settled yet."""
        return len(self._in_flight) + len(self._reported)

    # ----- dispatch ------------------------------------------------------

    @staticmethod
    def charge_for(request: Request, num_drafts: int, in_running_loop: bool) -> int:
        """The most a sampling chunk with ``num_drafts`` draft positions can
        emit: one token per draft plus one, and never more than the request
        may still produce. A waiting request's draft positions are vLLM's
        padding (``-1``), which its rejection sampler always rejects."""
        if not in_running_loop or num_drafts <= 0:
            return 1
        left = int(request.max_tokens - request.num_output_tokens)
        return max(1, min(1 + num_drafts, left))

    def fit_drafts(
        self,
        request: Request,
        num_drafts: int,
        num_new_tokens: int,
        in_running_loop: bool,
        budget: int,
    ) -> tuple[int, int]:
        """Trim a sampling chunk's ``num_drafts`` draft positions to what
        ``budget`` (at least 1) covers; return the tokens vLLM is to compute
        for the request and the tokens to charge, and note the charge."""
        charge = self.charge_for(request, num_drafts, in_running_loop)
        if charge > budget:
            # Keep budget - 1 drafts: the chunk then emits at most `budget`
            # tokens (vLLM schedules the drafts num_new_tokens covers).
            num_new_tokens -= num_drafts - (budget - 1)
            charge = self.charge_for(request, budget - 1, in_running_loop)
        self.charges[request.request_id] = charge
        return num_new_tokens, charge

    def record_step(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
        charges: Mapping[str, int] | None,
        reserved: Mapping[str, int] | None = None,
    ) -> Mapping[str, int]:
        """Keep the step's sampling dispatches; return the tokens charged per
        user.

        ``charges`` maps the request ids the policy's hook charged to their
        tokens; None in a fast step, where vLLM's own hook ran and each
        sampling chunk is charged one token plus the drafts scheduled with
        it (vLLM's padding of a request just taken from the queue included:
        given back when the step is reported). ``reserved``, in a fast step:
        each user's reservation, ``tokens_per_request`` per unfinished
        request; when the step's token counts show that every one of them
        was scheduled as a decode with every draft, that is the charge, and
        no request's drafts need counting. While the unfinished requests
        stay as ``most_per_user`` last saw them and the step's request ids
        are the same, a full step reuses the last one's requests and users.
        """
        ids = list(output.num_scheduled_tokens)
        if (
            reserved is not None
            and ids
            and not inflight_prefills
            and self._all_full(output, len(ids), reserved)
        ):
            last = self._last_full
            if last is not None and last[0] == ids:
                _, scheduled, users = last  # steady decoding
            else:
                scheduled = list(map(requests.__getitem__, ids))
                users = list(map(user_of, scheduled))
                self._last_full = (ids, scheduled, users)
            self._in_flight[id(output)] = _Step(
                output, step, time_ns, scheduled, users, reserved, full=True
            )
            return reserved
        scheduled = list(map(requests.__getitem__, ids))
        if inflight_prefills:  # some chunks stop short of the end
            sampling = [not chunk for chunk in map(_is_prefill_chunk, scheduled)]
            ids = [i for i, samples in zip(ids, sampling, strict=True) if samples]
            scheduled = list(filterfalse(_is_prefill_chunk, scheduled))
        if not scheduled:
            return {}
        users = list(map(user_of, scheduled))
        if charges is None:
            spec = output.scheduled_spec_decode_tokens
            drafts = map(len, map(spec.get, ids, repeat(_NO_DRAFTS)))
            counts: Iterable[int] = map((1).__add__, drafts)
        else:
            counts = map(charges.get, ids, repeat(0))
        charged = per_user(users, counts)
        self._in_flight[id(output)] = _Step(
            output, step, time_ns, scheduled, users, charged
        )
        return charged

    def _all_full(
        self, output: SchedulerOutput, num_scheduled: int, reserved: Mapping[str, int]
    ) -> bool:
        """Whether each of the ``num_scheduled`` requests was scheduled with
        ``tokens_per_request`` tokens, all but one of them drafts, and they
        are all the requests ``reserved`` was sized for. (Every chunk has at
        least one token besides its drafts, and at most ``num_spec_tokens``
        drafts: the totals decide.)"""
        per_request = self.tokens_per_request
        full = num_scheduled * per_request
        return (
            output.total_num_scheduled_tokens == full
            and num_drafts(output) == full - num_scheduled
            and sum(reserved.values()) == full
        )

    @property
    def wants_grants(self) -> bool:
        """Whether a step in flight may be reported after the next take."""
        return self._late_refunds and bool(self._in_flight)

    def note_grants(self, step: int, clock_ns: int, kept: Mapping[str, int]) -> None:
        """Record the step's takes (``kept``: tokens kept per user granted
        any), for the late refunds of steps still in flight."""
        grants = self._grants
        for user, count in kept.items():
            grants.setdefault(user, []).append((step, clock_ns, count))

    # ----- vLLM reports a step back (update_from_output) -------------------

    def before_report(self, output: SchedulerOutput) -> None:
        """Right before vLLM processes ``output``'s model output."""
        step = self._in_flight.get(id(output))
        if step is not None:
            step.before = list(map(len, map(_output_token_ids, step.requests)))

    def reported(self, output: SchedulerOutput) -> None:
        """Right after: what each user received from that step."""
        step = self._in_flight.pop(id(output), None)
        if step is None:
            return
        after = map(len, map(_output_token_ids, step.requests))
        received = per_user(step.users, map(sub, after, step.before))
        self._reported.append((step, received))

    # ----- the next refund point ------------------------------------------

    def refunds(self, absorbed: Callable[[KeysView[str]], bool]) -> Refunds:
        """What users were charged and did not receive from the steps
        reported since the last call (late ones oldest first). Also fills
        ``delivered``, ``delivered_at`` and ``undercharged``.

        ``absorbed(users)``: whether refunds to ``users`` would change
        nothing now (the limiter's ``refunds_absorbed``); then a full step's
        refunds are not even computed."""
        reported = self._reported
        if len(reported) == 1 and not self._grants:
            # Synchronous scheduling: the one step reported since the last
            # call, nothing taken since: one pass over its users.
            step, received = reported[0]
            self._reported = []
            self.delivered = received
            self.delivered_at = [(step.time_ns, received)]
            if step.full and absorbed(step.charged.keys()):
                # Nobody can have received more than charged, and giving
                # back changes nothing: users far below their limits.
                if self.undercharged:
                    self.undercharged = Counter()
                return _NONE_OWED
            get = received.get
            unreceived = {
                user: count - get(user, 0) for user, count in step.charged.items()
            }
            if (
                min(unreceived.values(), default=0) >= 0
                and received.keys() <= unreceived.keys()
            ):
                if self.undercharged:
                    self.undercharged = Counter()
                return Refunds(unreceived)
            self._reported = reported  # someone got more than charged
        self.undercharged = Counter()
        self.delivered = reported[0][1] if len(reported) == 1 else {}
        if len(reported) > 1:
            self.delivered = dict(sum((Counter(r) for _, r in reported), Counter()))
        self.delivered_at = [(step.time_ns, received) for step, received in reported]
        refunds = Refunds()
        plain, grants = refunds.plain, self._grants
        for step, received in reported:
            for user, charged in step.charged.items():
                owed = charged - received.get(user, 0)
                if owed > 0:
                    later = self._later_takes(user, step) if grants else None
                    if later:
                        refunds.late.append((user, owed, later))
                    else:
                        plain[user] = plain.get(user, 0) + owed
                elif owed < 0:
                    self.undercharged[user] -= owed
        self._reported = []
        self._prune_grants()
        return refunds

    def _later_takes(self, user: str, step: _Step) -> list[tuple[int, int]]:
        return [
            (clock_ns, kept)
            for number, clock_ns, kept in self._grants.get(user, ())
            if number > step.step
        ]

    def _prune_grants(self) -> None:
        """Forget takes no step in flight can need (those up to its own)."""
        if not self._grants:
            return
        if not self._in_flight:
            self._grants.clear()
            return
        oldest = min(step.step for step in self._in_flight.values())
        for user in list(self._grants):
            kept = [g for g in self._grants[user] if g[0] > oldest]
            if kept:
                self._grants[user] = kept
            else:
                del self._grants[user]
