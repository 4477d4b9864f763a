"""One contested step's residency accounts (no vLLM import).

``Residency.plan`` makes a ``StepSlots`` for a step in which requests wait;
the step's waiting-request hook (``Step.admit_waiting``) asks it and counts
each admission. Per user it holds the resident requests, the slots the user
still claims (``wanted``) and its reservation; the resident slots free now;
and, when the step's active slots were handed out by rank
(``ordering.share_slots``), the users granted one. It answers who may take a
slot and who may prefill ahead (rules 1 and 2 of docs/architecture.md,
"Nobody waits for a throttled request"). It lives for one step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any


class StepSlots:
    """One step's residency accounts; built by ``Residency.plan``."""

    def __init__(
        self,
        resident: Counter[str],
        wanted: dict[str, int],
        reserved: Mapping[str, int],
        may_grow: Callable[[str, int], bool],
        free: int,
    ) -> None:
        self.resident = resident
        self.wanted = wanted
        self.reserved = reserved
        self._may_grow = may_grow
        self.outstanding = sum(wanted.values())  # slots claimants still wait for
        self.free = free  # resident slots free now
        self.preempted_ids: set[str] = set()
        # Active slots handed to claimants by rank (``ordering.share_slots``);
        # None: any claimant may take a free slot.
        self.granted: dict[str, int] | None = None
        self.admissions = 0  # waiting requests let through in the step
        # What the step's scan depends on, when only prefill ahead can admit.
        self.scan_state: tuple[Any, ...] | None = None

    def may_take_a_slot(self, user: str) -> bool:
        """Whether a request of ``user``, which has budget now, may be
        admitted: if it is a claimant, or if that leaves a free slot for
        each slot still claimed (a user with budget that did not claim has
        it because one of its residents was deferred; slots freed for the
        claimants are theirs). When the step's slots were handed out by
        rank, only to a user granted one."""
        if self.granted is not None:
            return self.granted.get(user, 0) > 0
        return bool(self.wanted.get(user)) or self.free > self.outstanding

    def may_prefill_ahead(self, user: str) -> bool:
        """Whether a request of ``user``, which has no budget now, may be
        admitted to prefill ahead (rule 2)."""
        return not self.outstanding and self._may_grow(user, self.resident[user])

    def admitted(self, user: str) -> None:
        """Count a waiting request of ``user`` that vLLM may now admit."""
        self.resident[user] += 1
        self.free -= 1
        self.admissions += 1
        if self.granted:
            granted = self.granted.get(user, 0)
            if granted:
                self.granted[user] = granted - 1
        wanted = self.wanted.get(user)
        if wanted:
            self.wanted[user] = wanted - 1
            self.outstanding -= 1

    def may_give(self) -> bool:
        """Whether some user holds resident requests its budget cannot feed
        and claims none: only those can be taken back (rule 1)."""
        reserved, wanted = self.reserved, self.wanted
        return any(
            count > reserved.get(user, 0) and not wanted.get(user)
            for user, count in self.resident.items()
        )

    def grants_left(self) -> int:
        """Active slots granted by rank and not yet taken."""
        return sum(self.granted.values()) if self.granted else 0

    def left_waiting(self) -> list[str]:
        """Claimants still waiting for a slot (after the step's admissions)."""
        return [user for user, n in self.wanted.items() if n]

    def claimant_without_residents(self) -> bool:
        resident = self.resident
        return any(n and not resident[user] for user, n in self.wanted.items())

    def prefill_ahead_users(
        self, unfinished: Mapping[str, int]
    ) -> frozenset[str] | None:
        """The waiting users that may prefill ahead, or None when a claim is
        outstanding: then any scan may admit. (A waiting user whose budget
        its resident requests take is no claimant.)"""
        if self.outstanding:
            return None
        resident = self.resident
        growing = []
        for user, count in unfinished.items():
            have = resident[user]
            if count > have and self._may_grow(user, have):
                growing.append(user)
        return frozenset(growing)
