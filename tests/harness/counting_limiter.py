"""The real limiter, also counting its work (for tests and benchmarks).

* ``net``: tokens taken minus tokens refunded, per user. Every scheduler test
  checks the accounting invariant with it: a user's net charges equal the
  sampling steps the scheduler dispatched for that user.
* ``user_calls``: how often each user was asked for tokens.
* ``calls``: calls per public method of the limiter, including any added
  later; ``take_many`` counts once per user it handles, since that is the
  limiter's work. ``now_ns`` (a clock read) does not count.

Counting costs time itself, so the scheduler-cost benchmark times the plain
limiter and ``count_calls`` turns that very object (its state kept) into
this class for a few extra, untimed steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, KeysView, Mapping
from typing import Any

from vllm_output_rate.limiter import OutputRateLimiter

NOT_COUNTED = frozenset({"now_ns"})


class CountingLimiter(OutputRateLimiter):
    net: Counter[str]
    user_calls: Counter[str]
    calls: Counter[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.net, self.user_calls, self.calls = Counter(), Counter(), Counter()

    @classmethod
    def count_calls(cls, limiter: OutputRateLimiter) -> CountingLimiter:
        """Turn ``limiter`` into a CountingLimiter in place, counting from zero."""
        limiter.__class__ = cls
        assert isinstance(limiter, cls)
        limiter._reset_counts()
        return limiter

    def take_many(self, wanted: Mapping[str, int]) -> dict[str, int]:
        # Every take goes through here (try_take and take_up_to call it).
        self.calls["take_many"] += len(wanted)
        self.user_calls.update(wanted.keys())
        taken = super().take_many(wanted)
        self.net.update(taken)
        return taken

    def refund(self, user: str, count: int = 1) -> None:
        self.calls["refund"] += 1
        super().refund(user, count)
        if count > 0:
            self.net[user] -= count

    def refund_many(self, counts: Mapping[str, int]) -> None:
        self.calls["refund_many"] += 1
        super().refund_many(counts)
        self.net.subtract({u: c for u, c in counts.items() if c > 0})

    def refunds_absorbed(self, users: KeysView[str]) -> bool:
        # Never: every refund is then made, and counted in `net`. (The plain
        # limiter lets a caller skip refunds that change nothing; a test
        # compares it with this one, decision for decision.)
        self.calls["refunds_absorbed"] += 1
        return False

    def refund_late(
        self, user: str, count: int, later_takes: Iterable[tuple[int, int]] = ()
    ) -> None:
        self.calls["refund_late"] += 1
        later = list(later_takes)
        if later:
            self.calls["refund_late_after_takes"] += 1
        super().refund_late(user, count, later)
        if count > 0:
            self.net[user] -= count


def _counted(name: str) -> Callable[..., Any]:
    original = getattr(OutputRateLimiter, name)

    def method(self: CountingLimiter, *args: Any, **kwargs: Any) -> Any:
        self.calls[name] += 1
        return original(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name, _value in vars(OutputRateLimiter).items():
    if (
        not _name.startswith("_")
        and _name not in NOT_COUNTED
        and _name not in vars(CountingLimiter)
        and callable(_value)
    ):
        setattr(CountingLimiter, _name, _counted(_name))


def watch_updates(harness: Any) -> list[bool]:
    """Wrap the harness scheduler's ``update_from_output``; the returned list
    gets, per call, whether the call left the CountingLimiter untouched (no
    method called, no charge changed)."""
    limiter = harness.scheduler.output_rate.limiter
    untouched: list[bool] = []
    original = harness.scheduler.update_from_output

    def watched(*args: Any, **kwargs: Any) -> Any:
        before = sum(limiter.calls.values()), +limiter.net
        result = original(*args, **kwargs)
        untouched.append(before == (sum(limiter.calls.values()), +limiter.net))
        return result

    harness.scheduler.update_from_output = watched
    return untouched
