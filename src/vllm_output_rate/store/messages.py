"""What an engine and a shared budget store say to each other (no vLLM import).

The types every side of the store uses: one refresh's asks (``LeaseAsk``),
the store's answer (``Exchange``), the stored limits (``StoredLimits``), an
operator's change on its way to the store (``LimitsWrite``), one refresher
cycle (``Round``), and the errors a store raises. ``LeaseStore`` lists
exactly what the refresher and the engine's start-up need from a store;
``redis_store.RedisLeaseStore`` implements it. Only ``store/engine.py``
chooses the implementation; everything else speaks through these types.

How a store divides a user's limit, and why the shares keep the global bound:
docs/architecture.md, "The shared store".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

UNBOUNDED = -1.0  # a want: this engine could use more than it has


class StoreUnavailable(RuntimeError):
    """The store could not be reached or answered too late."""


class StoreIncompatible(StoreUnavailable):
    """The server answered, but not as a Redis-compatible store with Lua."""


@dataclass(frozen=True)
class LeaseAsk:
    """One user's part of a refresh: its weight (0: give the lease back) and
    want (tok/s it could use, or UNBOUNDED)."""

    user: str
    weight: float
    want: float = UNBOUNDED


@dataclass(frozen=True)
class Exchange:
    """The store's answer to one refresh."""

    now_us: int
    limits_version: int  # -1: the store holds no limits (new or restarted)
    engines: int  # engines with a live heartbeat, this one included
    fresh: bool  # this engine was not registered (new, or the store restarted)
    rates: dict[str, float]  # user -> this engine's share, tok/s
    shared: frozenset[str]  # users other engines hold a lease for too


@dataclass(frozen=True)
class StoredLimits:
    version: int
    default_rate: float
    user_rates: dict[str, float]
    # Each member's group, beside a table keyed by group (a teams' budget:
    # member -> team); empty for the users' budgets.
    members: dict[str, str] = field(default_factory=dict)


@dataclass
class LimitsWrite:
    """An operator's change made on this engine, to be written to the store."""

    default_rate: float | None
    user_rates: dict[str, float]
    remove_users: tuple[str, ...]
    members: dict[str, str] = field(default_factory=dict)
    remove_members: tuple[str, ...] = ()


@dataclass
class Round:
    """What the refresher sends in one cycle (built under the limiter's lock)."""

    asks: list[LeaseAsk]
    sent_ns: int
    limits_known: int  # the limits version this engine has applied
    writes: list[LimitsWrite]
    seed: tuple[float, dict[str, float]]  # our limits, for an empty store
    seed_members: dict[str, str] = field(default_factory=dict)  # and members


class LeaseStore(Protocol):
    """A shared store of leases and limits. Every call is one round trip and
    raises ``StoreUnavailable`` (or ``StoreIncompatible``) on failure."""

    def check(self) -> str:
        """Reach the store and prepare it; return the server's version."""
        ...

    def exchange(
        self,
        engine: str,
        asks: Sequence[LeaseAsk],
        *,
        grace_us: int,
        now_us: int | None = None,
    ) -> Exchange:
        """Heartbeat and lease shares for ``asks``, atomically. ``now_us``
        stands in for the store's clock (simulations only)."""
        ...

    def seed_limits(
        self,
        default_rate: float,
        user_rates: Mapping[str, float],
        members: Mapping[str, str] | None = None,
    ) -> bool:
        """Store these limits (and members) unless the store has some; True
        if stored."""
        ...

    def update_limits(
        self,
        *,
        default_rate: float | None,
        user_rates: Mapping[str, float],
        remove_users: Sequence[str],
        members: Mapping[str, str] | None = None,
        remove_members: Sequence[str] = (),
    ) -> int:
        """Apply a change to the stored limits (and members), in one new
        version; return it, or -1 when the store holds no limits (seed them
        first)."""
        ...

    def read_limits(self) -> StoredLimits | None:
        """The stored limits, or None when the store holds none."""
        ...

    def leave(self, engine: str) -> None:
        """Deregister (a clean shutdown); leases lapse on their own."""
        ...

    def close(self) -> None: ...
