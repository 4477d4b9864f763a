"""Keeping a saturated engine's batch between two rankings (no vLLM import).

With turns (``fair_share.TURN_TOKENS``) the ranking of a contested step
picks the same batch for many steps in a row. ``KeptBatch`` holds the last
ranking's batch (each user's last pick and next slot, the best key of the
users it picked nothing for) and answers, with ``still_first``, whether
ranking afresh now would pick the same batch, given that nothing the ranking
reads has changed (the caller, ``shortcuts.py``, checks that). Most answers
compare two numbers: a look at the keys records the least lead of a pick
over its first rival (``lead``), which holds while the counters have grown by
less than that in all. O(users served), never O(resident requests).

Why a kept step serves what a ranked step would have, so that the fair-share
bound is unchanged: docs/architecture.md, "Fair shares when the engine is
full" ("Kept batch").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_output_rate.scheduling.fair_share import TURN_TOKENS

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.fair_share import FairShare


@dataclass
class KeptBatch:
    """The last ranking's batch, for the steps that may keep it."""

    # user -> (its last slot k picked, its requests picked, whether that
    # slot's turn counted)
    last_picks: Mapping[str, tuple[int, list[Any], bool]]
    next_slots: Mapping[str, int]  # picked user -> its next slot k, unpicked
    rivals_key: Any  # the best (key, user) of the users picked nothing, or None
    waiting_users: frozenset[str]  # claimants left waiting (backlogged)
    requests: int = 0  # vLLM's unfinished requests after the last step
    running: int = 0  # and its running ones
    # How far every pick ranked ahead of every rival at the last look at the
    # keys, less what the counters can have grown since (``still_first``).
    slack: float = 0.0
    # What ``still_first`` answered when the last step was settled.
    ranks_first: bool = False
    # Free KV blocks a kept step needs to set the running requests beyond
    # the batch aside (None: it never does; set_aside.for_kept_batch).
    kv_blocks_needed: int | None = None

    def still_first(
        self, fair: FairShare, user_last_served: Mapping[str, int], grown: float
    ) -> bool:
        """Whether ranking afresh now would pick the same batch (given that
        nothing it reads has changed: the caller checks that). ``grown``:
        how much any user's counter, as the ranking reads it, can have grown
        since the last call (``FairShare.charge`` and the level's rise)."""
        self.slack -= grown
        if self.slack > _rounding(fair.level):
            return True
        lead = self.lead(fair, user_last_served)
        if lead is None:
            return False
        self.slack = lead
        return True

    def lead(
        self, fair: FairShare, user_last_served: Mapping[str, int]
    ) -> float | None:
        """How far every pick's key ranks ahead of every rival's, in
        counter units (0: by a tie-break or a floor only; infinite: no
        rival); None if some rival now ranks ahead of a pick."""
        served = user_last_served.get
        key = fair.key
        # (key, user), as the ranking's heap orders them (as
        # ordering.share_slots ranks a resident request's slot). The two
        # best next slots of picked users: a user's own does not count
        # against it.
        next_keys = sorted(
            ((True, key(u, k, served(u, -1), 0)), u) for u, k in self.next_slots.items()
        )[:2]
        lead = math.inf
        for user, (k, _, in_turn) in self.last_picks.items():
            rivals = [entry for entry in next_keys if entry[1] != user]
            if self.rivals_key is not None:
                rivals.append(self.rivals_key)
            if not rivals:
                continue
            # Every pick was served in each step since the ranking (the
            # policy keeps no batch otherwise), so each is in its turn.
            turn = TURN_TOKENS if in_turn else 0
            pick = ((True, key(user, k, served(user, -1), turn)), user)
            first = min(rivals)
            if pick > first:
                return None
            (pick_floor, pick_counter, _), (floor, counter, _) = pick[0][1], first[0][1]
            # Below a floor ranks first whatever the counters, and floor
            # credit moves with time: no lead to count on.
            lead = min(lead, counter - pick_counter if pick_floor == floor else 0.0)
        return lead


def _rounding(level: float) -> float:
    """A lead below this may be the counters' floating-point rounding: check
    the keys again (they are sums of tokens / weight, up to ``level``)."""
    return 1e-6 + 1e-12 * abs(level)
