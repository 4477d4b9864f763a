"""Who goes first: among resident requests, and for a scarce slot (no vLLM import).

``rotate_within_groups`` and ``share_slots`` order the running list for a
step; both return a new order and leave their input untouched.
``share_slots`` hands a scarce step's active slots to the users
owed most by ``fair_share.FairShare.key`` (weights, virtual service,
floors), running and waiting requests alike. ``slot_rank`` is the one
ranking of users for a scarce resident slot or KV blocks: ``claim_order``
hands slots to claimants by it and ``SlotHolders`` takes them back by it.
Requests are opaque; callers pass functions that read a request's user,
priority and the scheduler step at which it last received an output token.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import (
    Callable,
    Hashable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:
    from vllm_output_rate.scheduling.fair_share import FairShare

R = TypeVar("R")


def rotate_within_groups(
    requests: Sequence[R],
    group_of: Callable[[R], Hashable],
    last_served_of: Callable[[R], int],
) -> list[R]:
    """Let the streams of one group (one user, one priority) take turns.

    The positions a group holds in the list stay the same, so other groups'
    order is untouched; inside them, the group's request served least
    recently moves first. Without this the first stream in list order would
    take every token its user's budget frees.
    """
    positions: dict[Hashable, list[int]] = {}
    for index, request in enumerate(requests):
        positions.setdefault(group_of(request), []).append(index)
    rotated = list(requests)
    for indexes in positions.values():
        if len(indexes) > 1:
            members = sorted((requests[i] for i in indexes), key=last_served_of)
            for index, request in zip(indexes, members, strict=True):
                rotated[index] = request
    return rotated


class SharedSlots(NamedTuple, Generic[R]):
    """What ``share_slots`` decided for a step."""

    order: list[R]  # the requests, in the order vLLM should serve them
    granted: dict[str, int]  # slots handed to waiting requests, per user
    # For ``kept_batch``: each user's last running slot picked (its k, the
    # user's requests picked, whether that slot's turn was kept on); the
    # next slot k of each picked user left unpicked; the best (key, user) of
    # the users picked nothing (None: none), as the ranking's heap orders
    # them.
    last_picks: dict[str, tuple[int, list[R], bool]]
    next_slots: dict[str, int]
    rivals_key: Any


def share_slots(
    requests: Sequence[R],
    user_of: Callable[[R], str],
    last_served_of: Callable[[R], int],
    key_of: Callable[[str, int, int], Any],
    *,
    turn_left: Callable[[R], int] | None = None,
    weight_of: Callable[[str], float] | None = None,
    priority_of: Callable[[R], int] | None = None,
    limit_of: Callable[[str], int] | None = None,
    waiting: Mapping[str, int] | None = None,
    slots: int = 0,
    room: int = 0,
) -> SharedSlots[R]:
    """Hand a step's active slots out one at a time, best ``key_of`` first.

    ``key_of(user, k, turn)`` ranks the ``k``-th slot of ``user`` in this
    step, for a request whose turn keeps it on by ``turn`` tokens
    (``fair_share.FairShare.key``: the user owed most first, weighted
    round-robin in tokens, a request in its turn kept on). Each user's
    requests in their turn (``turn_left``) go first, then the one served
    least recently. A turn is kept on only within the user's
    weighted share of the slots (``weight_of``, ``weighted_shares``): a
    turn never holds a slot another user is owed by weight. With
    ``priority_of``, a lower priority value is served first (vLLM's
    convention) and the ranking applies within a priority. ``limit_of(user)``
    is how many slots the user's budget can use: its requests beyond that go
    last (they will be throttled).

    ``waiting`` (user -> waiting requests it could admit; FCFS only) competes
    for the first ``slots`` active slots too, at most ``room`` of them (free
    resident slots); a waiting user with nothing running takes its first
    slot ahead of every rank. Returns the requests in order, the slots
    handed to waiting requests per user (the caller gives the running
    requests ``slots`` minus those) and what ``kept_batch`` needs to tell
    whether a later step would rank the same (``SharedSlots``). Once
    ``slots`` are handed out the rest is not ranked (it is deferred in this
    step): the heap work is O(slots log U).
    """
    waiting = waiting or {}
    classes: dict[int, dict[str, list[R]]] = {}
    for request in requests:
        priority = priority_of(request) if priority_of else 0
        classes.setdefault(priority, {}).setdefault(user_of(request), []).append(
            request
        )
    if waiting:
        classes.setdefault(0, {})
    ordered: list[R] = []
    over_limit: list[R] = []
    granted: dict[str, int] = {}
    picked = 0
    last_picks: dict[str, tuple[int, list[R], bool]] = {}
    next_slots: dict[str, int] = {}
    rivals_key = None
    turns: Callable[[R], int] = turn_left or (lambda request: 0)

    def order(request: R) -> tuple[int, int]:
        return (-turns(request), last_served_of(request))

    protected: Mapping[str, float] = {}

    def kept_on(user: str, k: int, queue: Sequence[R]) -> bool:
        return k < len(queue) and k < protected.get(user, 0)

    def key(user: str, k: int, queue: Sequence[R]) -> Any:
        return key_of(user, k, turns(queue[k]) if kept_on(user, k, queue) else 0)

    for priority in sorted(classes):
        queues = {u: sorted(reqs, key=order) for u, reqs in classes[priority].items()}
        candidates = set(queues)
        candidates.update(waiting if priority == 0 else ())
        available = {}
        for user in candidates:
            count = len(queues.get(user, ())) + waiting.get(user, 0)
            if limit_of is not None:
                count = min(count, limit_of(user))
            available[user] = count
        if turn_left is not None and weight_of is not None and slots:
            shares = weighted_shares(slots - picked, available, weight_of)
            protected = {user: math.ceil(share) for user, share in shares.items()}
        # A waiting user with nothing running gets its first slot ahead of
        # every rank: a user that arrives with budget never waits for others
        # (README, "Nobody waits for a throttled request").
        heap = [
            ((u in queues, key(u, 0, queues.get(u, ()))), u)
            for u in candidates
            if available[u]
        ]
        heapq.heapify(heap)
        taken: Counter[str] = Counter()
        while heap:
            if slots and picked >= slots:
                for entry in heap:
                    if entry[1] in taken:
                        next_slots[entry[1]] = taken[entry[1]]
                    elif rivals_key is None or entry < rivals_key:
                        rivals_key = entry
                break  # the rest is deferred: no need to rank it
            _, user = heapq.heappop(heap)
            k = taken[user]
            queue = queues.get(user, ())
            if k < len(queue):
                ordered.append(queue[k])
                picks = last_picks[user][1] if user in last_picks else []
                picks.append(queue[k])
                last_picks[user] = (k, picks, kept_on(user, k, queue))
            elif picked < slots and room > 0:
                granted[user] = granted.get(user, 0) + 1
                room -= 1
            else:
                continue  # its waiting requests cannot get a slot now
            picked += 1
            taken[user] = k + 1
            if k + 1 < available[user]:
                heapq.heappush(heap, ((True, key(user, k + 1, queue)), user))
        deferred = []
        for user, queue in queues.items():
            rest = queue[min(taken[user], len(queue)) :]
            within = max(0, min(len(rest), available[user] - taken[user]))
            deferred.extend(rest[:within])
            over_limit.extend(rest[within:])
        ordered.extend(deferred)
    return SharedSlots(
        ordered + over_limit, granted, last_picks, next_slots, rivals_key
    )


def weighted_shares(
    slots: int, demand: Mapping[str, int], weight_of: Callable[[str], float]
) -> dict[str, float]:
    """Split ``slots`` between users by weight, none above its ``demand``
    (max-min fair: what a user cannot use goes to the others by weight)."""
    shares: dict[str, float] = {}
    left = {user: count for user, count in demand.items() if count > 0}
    free = float(slots)
    while left and free > 0:
        per_weight = free / sum(map(weight_of, left))
        full = [u for u, count in left.items() if count <= per_weight * weight_of(u)]
        if not full:
            shares.update((u, per_weight * weight_of(u)) for u in left)
            break
        for user in full:
            shares[user] = left.pop(user)
            free -= shares[user]
    return shares


# ----- who gets a scarce resident slot -----------------------------------------


def slot_rank(
    resident: int, last_served: int, fair: FairShare | None = None, user: str = ""
) -> tuple[float, float, int]:
    """The one ranking of users for a scarce resident slot (or KV), lower first.

    A user holding fewer resident requests per unit of weight comes first;
    among equals, the one owed most service (lowest virtual service,
    ``fair_share``), then the one served least recently. Claimants are
    served from the low end and slots are taken back from the high end
    (``SlotHolders``).
    """
    if fair is None:
        return (resident, 0.0, last_served)
    return (resident / fair.weight(user), fair.service(user), last_served)


def claim_order(
    wanted: Mapping[str, int],
    resident: MutableMapping[str, int],
    user_last_served: Mapping[str, int],
    fair: FairShare | None = None,
) -> Iterator[tuple[str, int]]:
    """Hand out slots one at a time to the users in ``wanted`` (user -> slots
    it can use now), best ranked first, re-ranking after each.

    Yields ``(user, resident requests before this slot)`` and counts the slot
    in ``resident``; the caller decides whether the slot can be had.
    """
    left = {user: n for user, n in wanted.items() if n > 0}
    heap = [
        (slot_rank(resident.get(u, 0), user_last_served.get(u, -1), fair, u), u)
        for u in left
    ]
    heapq.heapify(heap)
    while heap:
        _, user = heapq.heappop(heap)
        before = resident.get(user, 0)
        resident[user] = before + 1
        yield user, before
        left[user] -= 1
        if left[user]:
            rank = slot_rank(before + 1, user_last_served.get(user, -1), fair, user)
            heapq.heappush(heap, (rank, user))


class SlotHolders(Generic[R]):
    """Resident requests that may give their place back, grouped by holder.

    ``idle`` maps each holder to the requests it may give back, best victim
    first; ``feeds`` maps each holder to the resident requests its rate can
    feed. ``take(n)`` hands out one request for a claimant that holds ``n``
    resident requests, from a holder that either holds more than its rate
    can feed (a surplus costs it nothing) or holds more than the claimant (a
    slot moves towards the user holding fewer); holders with a surplus
    first, then the one ranked last by ``slot_rank``. ``resident`` is kept up
    to date. With ``priority_of``, only a request whose priority value is at
    least ``min_priority`` may be taken (vLLM's convention: lower is better).
    """

    def __init__(
        self,
        idle: Mapping[str, Sequence[R]],
        resident: MutableMapping[str, int],
        feeds: Callable[[str], int],
        user_last_served: Mapping[str, int],
        priority_of: Callable[[R], int] | None = None,
        fair: FairShare | None = None,
    ) -> None:
        self._fair = fair
        self._idle = {user: list(reqs) for user, reqs in idle.items() if reqs}
        self._resident = resident
        self._feeds = {user: feeds(user) for user in self._idle}
        self._last_served = user_last_served
        self._priority_of = priority_of

    def __bool__(self) -> bool:
        return bool(self._idle)

    def take(self, resident: int, min_priority: int | None = None) -> R | None:
        best: tuple[tuple[bool, tuple[float, float, int]], str, int] | None = None
        for user, requests in self._idle.items():
            have = self._resident.get(user, 0)
            surplus = have > self._feeds[user]
            if not (surplus or have > resident):
                continue
            index = self._first_allowed(requests, min_priority)
            if index is None:
                continue
            last_served = self._last_served.get(user, -1)
            key = (surplus, slot_rank(have, last_served, self._fair, user))
            if best is None or key > best[0]:
                best = (key, user, index)
        if best is None:
            return None
        _, user, index = best
        requests = self._idle[user]
        taken = requests.pop(index)
        if not requests:
            del self._idle[user]
        self._resident[user] -= 1
        return taken

    def _first_allowed(self, requests: list[R], min_priority: int | None) -> int | None:
        if self._priority_of is None or min_priority is None:
            return 0
        priority_of = self._priority_of
        for index, request in enumerate(requests):
            if priority_of(request) >= min_priority:
                return index
        return None
