"""What the scheduling policy needs from a per-user budget (no vLLM import).

Two implementations, chosen at start-up like the storage backends of the
``limits`` library or PyrateLimiter:

* ``limiter.OutputRateLimiter``: GCRA in this engine's memory (the embedded
  default; one engine, one budget per user);
* ``store.leases.LeasedLimiter``: the same GCRA pacing, at this engine's
  share of each user's limit, leased from a shared Redis/Valkey store so that
  one budget per user holds across every engine using the store.

The policy calls only what is listed here, once per step in one batch
(``take_many``) plus refunds at its single refund point (with speculative
decoding, also refunds of drafts a later report says were rejected). The last
four calls are what a shared store needs of the engine: a view of whether it
has requests, the step's demand between steps (leases follow it), answers
applied while the engine is idle, and the store's state for operators. The
embedded limiter does nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, KeysView, Mapping
from typing import Any, Protocol


class Budget(Protocol):
    @property
    def burst_ns(self) -> int: ...

    @property
    def default_rate(self) -> float: ...

    @property
    def user_rates(self) -> dict[str, float]: ...

    def now_ns(self) -> int: ...

    def rate_of(self, user: str) -> float: ...

    def take_many(self, wanted: Mapping[str, int]) -> dict[str, int]: ...

    @property
    def last_take_ns(self) -> int:
        """The clock reading at which the last ``take_many`` admitted."""
        ...

    def take_up_to(self, user: str, wanted: int) -> int: ...

    def refund(self, user: str, count: int = 1) -> None: ...

    def refund_many(self, counts: Mapping[str, int]) -> None: ...

    def refunds_absorbed(self, users: KeysView[str]) -> bool:
        """Whether refunds to ``users`` now would change nothing (a caller
        may then skip computing them)."""
        ...

    def refund_late(
        self, user: str, count: int, later_takes: Iterable[tuple[int, int]] = ()
    ) -> None: ...

    def tokens_within(self, user: str, window_ns: int) -> int: ...

    def ready_at_ns(self, user: str) -> int: ...

    def cleanup_idle_users(self) -> int: ...

    def update_rates(
        self,
        *,
        default_rate: float | None = None,
        user_rates: Mapping[str, float] | None = None,
        remove_users: Iterable[str] = (),
    ) -> None: ...

    def attach(self, has_requests: Callable[[], bool]) -> None:
        """``has_requests()``: whether the engine has unfinished requests."""
        ...

    def between_steps(self, demand: Mapping[str, int], generation: object) -> None:
        """Before a step's reservation: its unfinished requests per user
        (``generation`` changes whenever a user joins or leaves them)."""
        ...

    def apply_pending(self) -> None:
        """Apply what arrived since the last step (an idle engine takes none)."""
        ...

    def store_snapshot(self) -> dict[str, Any] | None:
        """The shared store's state for operators; None without a store."""
        ...
