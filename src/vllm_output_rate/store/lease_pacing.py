"""The step budget's calls, paced at this engine's leases (no vLLM import).

``LeasePacing`` answers the policy's ``budget.Budget`` calls but the
operator's ``update_rates`` and the store's hooks, which
``leases.LeasedLimiter`` adds to it: each user is paced by the local
``OutputRateLimiter`` (the *pacer*) at this engine's lease of its limit; a
*blocked* user (demand and no usable lease yet) is granted nothing and
looked at again soon (at once while it waits for its first answer); a
shared user's tokens taken and refunded and its steps held back are counted
on its lease, for its next ask (``lease.Lease.report_want``). Scheduler
thread only, without the lock: a lease the refresher thread lets go
meanwhile is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, KeysView, Mapping

from vllm_output_rate.limiter import OutputRateLimiter
from vllm_output_rate.store.lease_table import LeaseTable

# A blocked user waiting for its first answer is looked at again this soon.
FIRST_ANSWER_POLL_NS = 2_000_000


class LeasePacing:
    """The pacer at this engine's leases, and the table it reads them from."""

    # Set by LeasedLimiter.
    pacer: OutputRateLimiter
    table: LeaseTable
    _clock: Callable[[], int]

    @property
    def burst_ns(self) -> int:
        return self.pacer.burst_ns

    def now_ns(self) -> int:
        return self._clock()

    @property
    def default_rate(self) -> float:
        return self.table.default_rate

    @property
    def user_rates(self) -> dict[str, float]:
        return dict(self.table.user_rates)

    def rate_of(self, user: str) -> float:
        return self.table.rate_of(user)

    @property
    def last_take_ns(self) -> int:
        return self.pacer.last_take_ns

    def take_many(self, wanted: Mapping[str, int]) -> dict[str, int]:
        table = self.table
        blocked = table.blocked
        if blocked and not blocked.isdisjoint(wanted):
            got = self.pacer.take_many(
                {u: c for u, c in wanted.items() if u not in blocked}
            )
            got.update(dict.fromkeys(blocked.intersection(wanted), 0))
        else:
            got = self.pacer.take_many(wanted)
        if table.shared:
            leases = table.leases
            for user in table.shared.intersection(got):
                lease = leases.get(user)  # the refresher may have let it go
                if lease is not None:
                    lease.used += got[user]
                    if got[user] < wanted[user]:
                        lease.held_back += 1
        return got

    def take_up_to(self, user: str, wanted: int) -> int:
        return self.take_many({user: wanted})[user]

    def try_take(self, user: str) -> bool:
        return self.take_up_to(user, 1) == 1

    def refund(self, user: str, count: int = 1) -> None:
        self.pacer.refund(user, count)
        self._unuse(user, count)

    def refund_many(self, counts: Mapping[str, int]) -> None:
        for user, count in counts.items():
            self.refund(user, count)

    def refunds_absorbed(self, users: KeysView[str]) -> bool:
        # A shared user's refunds also go back to its lease.
        return self.table.shared.isdisjoint(users) and self.pacer.refunds_absorbed(
            users
        )

    def refund_late(
        self, user: str, count: int, later_takes: Iterable[tuple[int, int]] = ()
    ) -> None:
        """``OutputRateLimiter.refund_late`` at this engine's share (speculative
        decoding: drafts a later report says were rejected)."""
        self.pacer.refund_late(user, count, later_takes)
        self._unuse(user, count)

    def _unuse(self, user: str, count: int) -> None:
        """A shared user's refunded tokens were not used after all."""
        table = self.table
        lease = table.leases.get(user) if table.shared else None
        if lease is not None and lease.shared and count > 0:
            lease.used -= count

    def tokens_within(self, user: str, window_ns: int) -> int:
        """At this engine's share of the limit (none while it waits for one)."""
        if user in self.table.blocked:
            return 0
        return self.pacer.tokens_within(user, window_ns)

    def ready_at_ns(self, user: str) -> int:
        table = self.table
        if user in table.blocked:
            now = self._clock()
            wait = FIRST_ANSWER_POLL_NS if user in table.awaiting else table.refresh_ns
            return now + wait
        return self.pacer.ready_at_ns(user)

    def cleanup_idle_users(self) -> int:
        return self.pacer.cleanup_idle_users()

    def __len__(self) -> int:
        return len(self.pacer)
