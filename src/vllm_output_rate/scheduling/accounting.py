"""How a step's tokens are counted: plain decoding or speculative decoding.

The step never asks which one it runs; it asks its ``Accounting``:

* ``demand``: the most tokens each user's unfinished requests can sample in
  one step (the step's reservation is sized to it);
* ``charge``: what a sampling chunk costs, and the chunk trimmed to the
  user's budget;
* ``dispatched`` / ``charged_from_output``: keep what the step dispatched,
  charged by our hook or (a shortcut's step) read from vLLM's output;
* ``received``: what users received, for fair shares and statistics;
* ``give_back``: before a reservation, return what users were charged and
  did not receive.

``PlainAccounting``: a sampling chunk emits exactly one token, known at
dispatch. ``SpeculativeAccounting``: it emits one token plus up to its
drafts, known only when the step is reported (``speculative.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from vllm_output_rate.budget import Budget
from vllm_output_rate.scheduling.demand import Demand
from vllm_output_rate.scheduling.dispatch_log import DispatchLog
from vllm_output_rate.scheduling.speculative import SpeculativeLedger

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class Accounting(Protocol):
    # Tokens one request can be charged in a step.
    tokens_per_request: int
    # Whether a step's charges are final at dispatch (a kept step may then
    # let vLLM's own hook run and charge from the output).
    charges_known_at_dispatch: bool

    def give_back(self, limiter: Budget, logger: logging.Logger) -> None: ...

    def demand(self, unfinished: Mapping[str, int], changes: int) -> Mapping[str, int]:
        """The most each user can be charged in the step; also starts the
        step's charges. ``changes``: ``Demand.changes``, for caching."""
        ...

    def charge(
        self,
        request: Request,
        num_drafts: int,
        num_new_tokens: int,
        in_running_loop: bool,
        budget: int,
    ) -> tuple[int, int]:
        """For a sampling chunk of ``num_new_tokens`` with ``num_drafts`` draft
        positions, the tokens vLLM is to compute and the tokens to charge,
        within ``budget`` (at least 1)."""
        ...

    def charge_of(self, request_id: str) -> int:
        """What ``charge`` charged the request in this step."""
        ...

    def dispatched(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
    ) -> None:
        """Our hook charged the step's chunks: keep what it dispatched."""
        ...

    def charged_from_output(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
        demand: Demand,
        reserved: Mapping[str, int],
    ) -> Mapping[str, int]:
        """vLLM's hook ran (nobody could be refused): the tokens per user the
        step's sampling chunks are charged, read from its output."""
        ...

    def received(self, served: Mapping[str, int]) -> Mapping[str, int]:
        """What users received, known at the step's settling."""
        ...

    def log(
        self, dispatch_log: DispatchLog, time_ns: int, served: Mapping[str, int]
    ) -> None: ...

    def wants_grants(self) -> bool: ...

    def note_grants(self, step: int, time_ns: int, kept: Mapping[str, int]) -> None: ...

    def before_report(self, output: SchedulerOutput) -> None: ...

    def reported(self, output: SchedulerOutput) -> None: ...


class PlainAccounting:
    """One token per sampling chunk, charged at dispatch, final."""

    tokens_per_request = 1
    charges_known_at_dispatch = True

    def give_back(self, limiter: Budget, logger: logging.Logger) -> None:
        pass

    def demand(self, unfinished: Mapping[str, int], changes: int) -> Mapping[str, int]:
        return unfinished

    def charge(
        self,
        request: Request,
        num_drafts: int,
        num_new_tokens: int,
        in_running_loop: bool,
        budget: int,
    ) -> tuple[int, int]:
        return num_new_tokens, 1

    def charge_of(self, request_id: str) -> int:
        return 1

    def dispatched(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
    ) -> None:
        pass

    def charged_from_output(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
        demand: Demand,
        reserved: Mapping[str, int],
    ) -> Mapping[str, int]:
        return demand.count_sampled(
            output.num_scheduled_tokens, inflight_prefills, requests
        )

    def received(self, served: Mapping[str, int]) -> Mapping[str, int]:
        return served

    def log(
        self, dispatch_log: DispatchLog, time_ns: int, served: Mapping[str, int]
    ) -> None:
        # Stamped with the time the tokens were taken (the step's start), so
        # that windows between stamps are the limiter's own.
        dispatch_log.record(time_ns, served)

    def wants_grants(self) -> bool:
        return False

    def note_grants(self, step: int, time_ns: int, kept: Mapping[str, int]) -> None:
        pass

    def before_report(self, output: SchedulerOutput) -> None:
        pass

    def reported(self, output: SchedulerOutput) -> None:
        pass


class SpeculativeAccounting:
    """A sampling chunk is charged the most it can emit (one token plus its
    drafts, trimmed first to the user's budget); what it did not emit goes
    back before a later step's reservation (``speculative.py``)."""

    charges_known_at_dispatch = False

    def __init__(self, num_spec_tokens: int, *, late_outputs: bool) -> None:
        self.ledger = SpeculativeLedger(num_spec_tokens, late_refunds=late_outputs)
        self.tokens_per_request = self.ledger.tokens_per_request

    def give_back(self, limiter: Budget, logger: logging.Logger) -> None:
        ledger = self.ledger
        refunds = ledger.refunds(limiter.refunds_absorbed)
        for user, count, later_takes in refunds.late:
            limiter.refund_late(user, count, later_takes)
        if refunds.plain:
            limiter.refund_many(refunds.plain)
        if ledger.undercharged:
            logger.warning(
                "Users received more tokens than they were charged: %s",
                dict(ledger.undercharged),
            )
            for user, count in ledger.undercharged.items():
                limiter.take_up_to(user, count)

    def demand(self, unfinished: Mapping[str, int], changes: int) -> Mapping[str, int]:
        self.ledger.charges.clear()
        return self.ledger.most_per_user(unfinished, changes)

    def charge(
        self,
        request: Request,
        num_drafts: int,
        num_new_tokens: int,
        in_running_loop: bool,
        budget: int,
    ) -> tuple[int, int]:
        return self.ledger.fit_drafts(
            request, num_drafts, num_new_tokens, in_running_loop, budget
        )

    def charge_of(self, request_id: str) -> int:
        return self.ledger.charges[request_id]

    def dispatched(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
    ) -> None:
        ledger = self.ledger
        ledger.record_step(
            step, time_ns, output, requests, inflight_prefills, ledger.charges
        )

    def charged_from_output(
        self,
        step: int,
        time_ns: int,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        inflight_prefills: Collection[Request],
        demand: Demand,
        reserved: Mapping[str, int],
    ) -> Mapping[str, int]:
        # The most each chunk can emit (it may carry draft tokens).
        return self.ledger.record_step(
            step, time_ns, output, requests, inflight_prefills, None, reserved=reserved
        )

    def received(self, served: Mapping[str, int]) -> Mapping[str, int]:
        # Known only for the steps reported since the last step.
        return self.ledger.delivered

    def log(
        self, dispatch_log: DispatchLog, time_ns: int, served: Mapping[str, int]
    ) -> None:
        for dispatch_ns, tokens in self.ledger.delivered_at:
            dispatch_log.record(dispatch_ns, tokens)

    def wants_grants(self) -> bool:
        return self.ledger.wants_grants

    def note_grants(self, step: int, time_ns: int, kept: Mapping[str, int]) -> None:
        self.ledger.note_grants(step, time_ns, kept)

    def before_report(self, output: SchedulerOutput) -> None:
        self.ledger.before_report(output)

    def reported(self, output: SchedulerOutput) -> None:
        self.ledger.reported(output)


def accounting_for(num_spec_tokens: int, *, late_outputs: bool) -> Accounting:
    """Speculative accounts when the engine proposes drafts, else plain ones.
    ``late_outputs``: a step's output can arrive after the next step was
    scheduled (asynchronous scheduling, pipeline parallelism)."""
    if num_spec_tokens > 0:
        return SpeculativeAccounting(num_spec_tokens, late_outputs=late_outputs)
    return PlainAccounting()
