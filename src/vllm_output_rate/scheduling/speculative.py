"""Speculative decoding's accounts: charge the most a step can emit, give
back what it did not emit.

A decode step that verifies k draft tokens emits between 1 and k + 1 tokens
(the accepted drafts and one more), and how many is known only after the
model ran. The policy therefore charges, at dispatch, the most the step can
emit (``charge_for``; drafts are trimmed first to what the user's budget
covers) and this module keeps, per request, the charges of the steps vLLM
has not reported back yet. At the start of every step (``resolve``) it finds
the tokens that were charged but will never reach the user (rejected drafts,
tokens cut by a stop, steps of a request that finished or was aborted
meanwhile) and the policy gives them back at its single refund point, before
the step's own reservation. ``update_from_output`` never touches the
limiter, so asynchronous scheduling keeps working.

Which steps vLLM has reported is read from the request, not learnt in
``update_from_output``: for each step in flight vLLM adds 1 + the drafts it
scheduled to ``num_output_placeholders`` (asynchronous scheduling; always 0
when synchronous) and removes them when that step's output arrives, so the
newest dispatches whose sizes add up to ``num_output_placeholders`` are still
in flight and every older one has been reported; the tokens the user
received are ``num_output_tokens``. A preempted request whose in-flight
output will still be delivered (``num_stale_output_tokens``) waits until
that output has arrived.

With asynchronous scheduling (or pipeline parallelism) a step's output
arrives after later steps already took budget for the same user. Those
takes are recorded (``note_grants``) and handed to the limiter's
``refund_late``, which gives the tokens back without moving the later
tokens ahead of their slots: the limiter ends exactly where GCRA over the
delivered tokens would, so the bound ``(W + 0.1) x limit + 1`` holds for
what users receive and the long-run rate is the limit.

The accounting invariant: over a request's life, charges minus refunds equal
the tokens it received.

Requests are vLLM ``Request`` objects, read through the attributes listed in
``seams.REQUEST_ATTRIBUTES``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_output_rate.scheduling.demand import user_of

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass(slots=True)
class _Dispatch:
    step: int
    time_ns: int
    size: int  # what vLLM added to num_output_placeholders: 1 + drafts
    charge: int  # tokens charged for it


@dataclass(slots=True)
class _Account:
    request: Request
    in_flight: deque[_Dispatch] = field(default_factory=deque)
    # Charged for reported dispatches, minus tokens received and refunds.
    owed: int = 0
    # num_output_tokens when last resolved.
    seen_outputs: int = 0


@dataclass(slots=True)
class Refund:
    """Tokens to give back to one user, owed since ``since_step``; and the
    user's takes granted after that step, for the limiter's ``refund_late``."""

    count: int = 0
    since_step: int = 0
    later_takes: list[tuple[int, int]] = field(default_factory=list)


class SpeculativeLedger:
    def __init__(self, num_spec_tokens: int, *, late_refunds: bool) -> None:
        # Tokens one request can be charged in a step: one plus every draft.
        self.tokens_per_request = 1 + num_spec_tokens
        # Whether a step's output can arrive after the next step took budget
        # (asynchronous scheduling, pipeline parallelism).
        self._late_refunds = late_refunds
        self._accounts: dict[str, _Account] = {}
        # user -> [(step, clock_ns, kept)] of the takes granted since the
        # oldest dispatch still in flight (late refunds only).
        self._grants: dict[str, list[tuple[int, int, int]]] = {}
        # Charges of this step's requests (request id -> tokens), set by the
        # policy's hook in steps where it runs.
        self.charges: dict[str, int] = {}
        # Delivered tokens found by the latest resolve(), per user and by
        # the clock reading of the step that dispatched them.
        self.delivered: Counter[str] = Counter()
        self.delivered_at: list[tuple[int, str, int]] = []
        # Received more than charged (would be a bug); the policy charges the
        # excess after the fact and logs it.
        self.undercharged: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._accounts)

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

    def record_step(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        charges: Mapping[str, int] | None,
    ) -> Counter[str]:
        """Keep the step's sampling dispatches; return the tokens charged per user.

        ``charges`` maps the request ids the policy's hook charged to their
        tokens (dispatched or not); None in a fast step, where vLLM's own
        hook ran and every dispatch is charged here the most it can emit.
        """
        spec = output.scheduled_spec_decode_tokens
        fresh: set[str] = set()
        if charges is None:
            fresh = {r.req_id for r in output.scheduled_new_reqs}
            fresh |= output.scheduled_cached_reqs.resumed_req_ids
        charged: Counter[str] = Counter()
        accounts = self._accounts
        for request_id in output.num_scheduled_tokens:
            request = requests[request_id]
            if request.is_prefill_chunk:
                continue  # stops short of the end: samples nothing
            size = 1 + len(spec.get(request_id, ()))
            if charges is None:
                charge = self.charge_for(request, size - 1, request_id not in fresh)
            else:
                charge = charges.get(request_id, 0)
            account = accounts.get(request_id)
            if account is None or account.request is not request:
                account = accounts[request_id] = _Account(
                    request, seen_outputs=request.num_output_tokens
                )
            account.in_flight.append(_Dispatch(step, time_ns, size, charge))
            charged[user_of(request)] += charge
        return charged

    def note_grants(self, step: int, clock_ns: int, kept: Mapping[str, int]) -> None:
        """Record the step's takes (``kept``: tokens kept per user granted
        any), for the late refunds of dispatches still in flight."""
        if not self._late_refunds or not self._accounts:
            return
        grants = self._grants
        for user, count in kept.items():
            grants.setdefault(user, []).append((step, clock_ns, count))

    # ----- the next steps ------------------------------------------------

    def resolve(self) -> dict[str, Refund]:
        """Find the tokens charged for reported steps that users did not get.

        Also fills ``delivered``/``delivered_at`` with the tokens received
        since the last call, and ``undercharged``.
        """
        refunds: dict[str, Refund] = {}
        self.delivered = Counter()
        self.delivered_at = []
        self.undercharged = Counter()
        oldest_in_flight: int | None = None
        finished: list[str] = []
        for request_id, account in self._accounts.items():
            request = account.request
            reported = self._reported(account)
            if account.in_flight:
                step = account.in_flight[0].step
                if oldest_in_flight is None or step < oldest_in_flight:
                    oldest_in_flight = step
            elif request.is_finished():
                finished.append(request_id)
            if reported is None:
                continue  # its in-flight output has not been delivered yet
            outputs = request.num_output_tokens
            received = outputs - account.seen_outputs
            if received < 0:  # a streaming session moved its output into the prompt
                received = outputs
            account.seen_outputs = outputs
            user = user_of(request)
            if reported:
                self._log_delivered(reported, received, user)
                account.owed += sum(d.charge for d in reported)
            account.owed -= received
            self.delivered[user] += received
            if account.owed > 0 and reported:
                refund = refunds.get(user)
                since = reported[0].step
                if refund is None:
                    refund = refunds[user] = Refund(since_step=since)
                refund.count += account.owed
                refund.since_step = min(refund.since_step, since)
                account.owed = 0
            elif account.owed < 0:
                self.undercharged[user] -= account.owed
                account.owed = 0
        for request_id in finished:
            del self._accounts[request_id]
        for user, refund in refunds.items():
            refund.later_takes = [
                (clock_ns, kept)
                for step, clock_ns, kept in self._grants.get(user, ())
                if step > refund.since_step
            ]
        self._prune_grants(oldest_in_flight)
        return refunds

    def _reported(self, account: _Account) -> list[_Dispatch] | None:
        """Pop and return the account's dispatches vLLM has reported back
        (all of them once the request finished); None while a preempted
        request's output is still on its way."""
        request = account.request
        in_flight = account.in_flight
        if request.is_finished():
            reported = list(in_flight)
            in_flight.clear()
            return reported
        if request.num_stale_output_tokens and not request.drop_stale_output:
            return None
        pending = request.num_output_placeholders
        # The newest dispatches whose sizes add up to `pending` are in flight.
        keep = 0
        for dispatch in reversed(in_flight):
            if pending <= 0:
                break
            pending -= dispatch.size
            keep += 1
        if pending != 0:
            # Not a sum of the newest sizes: an accounting vLLM changed.
            # Refund nothing now (never more than is owed); a finished
            # request settles in full.
            return None
        reported = [in_flight.popleft() for _ in range(len(in_flight) - keep)]
        return reported

    def _log_delivered(
        self, reported: list[_Dispatch], received: int, user: str
    ) -> None:
        """Attribute received tokens to the dispatches they came from, oldest
        first (usually exactly one)."""
        for dispatch in reported:
            if received <= 0:
                return
            count = min(received, dispatch.charge)
            self.delivered_at.append((dispatch.time_ns, user, count))
            received -= count

    def _prune_grants(self, oldest_in_flight: int | None) -> None:
        if not self._grants:
            return
        if oldest_in_flight is None:
            self._grants.clear()
            return
        for user in list(self._grants):
            kept = [g for g in self._grants[user] if g[0] > oldest_in_flight]
            if kept:
                self._grants[user] = kept
            else:
                del self._grants[user]
