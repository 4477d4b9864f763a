"""Keeping a saturated engine's batch between two rankings (no vLLM import).

On a saturated engine where no limit binds, every step hands the active
slots out by rank (``ordering.share_slots``), and ranking costs the
scheduler about as much again as vLLM's own step on a small model. With
turns (``fair_share.TURN_STEPS``) the ranking picks the same batch for many
steps in a row, so a step may keep the last ranking's batch instead, as long
as ranking afresh could not pick otherwise:

* nothing the ranking read has changed: no request arrived, finished,
  was admitted, preempted or throttled, no limit or weight changed, every
  active slot was filled by a running request, and no user with a floor
  (whose credit grows with time) has unfinished requests;
* no picked request's turn has ended (``until``): then its user's next
  request takes the slot;
* every user's last pick still ranks ahead of every key left unpicked:
  the next slot of each other picked user (recomputed, as its counter grows)
  and the best key of the users picked nothing (``rivals_key``, kept from
  the ranking: their counters do not move while they receive nothing, and
  the level only rises, so their keys cannot fall). A user's own next slot
  always ranks behind its last pick.

So a kept step serves what a ranked step would have, and the bound on the
service difference (docs/architecture.md, "Fair shares") is unchanged. The
check is O(users served), never O(resident requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_output_rate.scheduling.fair_share import steps_left_in_turn

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.fair_share import FairShare


@dataclass
class KeptBatch:
    """The last ranking's batch, for the steps that may keep it."""

    until: int  # the first step at which a picked request's turn has ended
    # user -> (its last slot k picked, its requests picked, whether that
    # slot's turn counted)
    last_picks: Mapping[str, tuple[int, list[Any], bool]]
    next_slots: Mapping[str, int]  # picked user -> its next slot k, unpicked
    rivals_key: Any  # the best (key, user) of the users picked nothing, or None
    waiting_users: frozenset[str]  # claimants left waiting (backlogged)
    # Picked user whose last slot's turn counted -> the earliest turn start
    # among its picks. Every pick was served in each step since the ranking
    # (the policy keeps no batch otherwise), so no turn start moves and the
    # pick with the least turn left is the one that started first.
    turn_starts: Mapping[str, int]
    requests: int = 0  # vLLM's unfinished requests after the last step
    running: int = 0  # and its running ones

    def still_first(
        self, step: int, fair: FairShare, user_last_served: Mapping[str, int]
    ) -> bool:
        """Whether ranking afresh in ``step`` would pick the same batch
        (given that nothing it reads has changed: the caller checks that)."""
        if step >= self.until:
            return False
        served = user_last_served.get
        key = fair.key
        # (key, user), as the ranking's heap orders them (as
        # ordering.share_slots ranks a resident request's slot). The two
        # best next slots of picked users: a user's own does not count
        # against it.
        next_keys = sorted(
            ((True, key(u, k, served(u, -1), 0)), u) for u, k in self.next_slots.items()
        )[:2]
        turn_starts = self.turn_starts
        for user, (k, _, _) in self.last_picks.items():
            rivals = [entry for entry in next_keys if entry[1] != user]
            if self.rivals_key is not None:
                rivals.append(self.rivals_key)
            if not rivals:
                continue
            # A user's requests rank by the turn they have left, most first:
            # its last slot goes with the least left (turns end at their own
            # steps, so that order can change between steps).
            start = turn_starts.get(user)
            turn = 0 if start is None else steps_left_in_turn(start, step)
            pick = ((True, key(user, k, served(user, -1), turn)), user)
            if pick > min(rivals):
                return False
        return True
