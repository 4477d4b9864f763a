"""A ranking's candidates and their slot keys, popped as ``share_slots`` does.

``Rows`` holds the users one ranking by the rotations (``rotations.py``)
looks at, column by column. ``make_entries`` gives each row the keys of
its next slots: ``FairShare.key`` of the ``k``-th, ``counter + (k - turn) /
weight`` (no floors), flattened into ``Entry`` tuples that sort as
``share_slots``' heap entries do. ``Scan`` hands the slots out over the
sorted entries as that heap's pops would: each to a running request, or to
a waiting one while free resident places last; once they are gone a waiting
user drops out. A user has as many entries as its slots may reach: ``short``
names the rows that took every entry made, and may need more. No vLLM
import.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, filterfalse
from operator import itemgetter
from typing import Any

from vllm_output_rate.scheduling.fair_share import TURN_TOKENS

# share_slots' heap entry ((in_queue, (floor flag, counter + (k - turn) /
# weight, last served)), user), less what entries here do not differ in
# (in_queue is false only for a waiting user's first slot, kept apart in
# ``heads``; no floors), then the slot's k and whether it is for a waiting
# request. A user's k differ, so no two entries tie.
Entry = tuple[float, int, str, int, bool]
_user_of_entry, _k_of_entry, _is_grant = itemgetter(2), itemgetter(3), itemgetter(4)


class Rows:
    """The users a step ranks, as parallel columns (one row per user)."""

    def __init__(self) -> None:
        self.users: list[str] = []
        self.sizes: list[int] = []  # running requests
        self.in_turn: list[int] = []  # of those, served in the last step
        self.turns: list[int] = []  # of those, keeping their turn
        self.available: list[int] = []  # slots it can use (running, claimed)
        self.made: list[int] = []  # entries made so far
        self.counters: list[float] = []  # FairShare.service
        self.weights: list[float] = []
        self.lasts: list[int] = []  # its last step served


def make_entries(
    rows: Rows, targets: Iterable[int], entries: list[Entry], heads: list[Entry]
) -> None:
    """Add each row's entries up to its target (at most what it has
    available): ``FairShare.key`` of its ``k``-th slot, ``counter + (k -
    turn) / weight``, with a turn for its first requests in turn. A waiting
    user's first slot goes to ``heads`` (it ranks ahead of every key)."""
    made = rows.made
    stops = [min(n, a) for n, a in zip(targets, rows.available, strict=False)]
    stops += made[len(stops) :]  # rows without a target keep theirs
    tokens = TURN_TOKENS
    columns = zip(
        rows.counters,
        rows.weights,
        rows.lasts,
        rows.users,
        rows.sizes,
        rows.turns,
        made,
        stops,
        strict=True,
    )
    entries += [
        (
            counter + (k - (tokens if k < turns else 0)) / weight,
            last,
            user,
            k,
            k >= size,
        )
        for counter, weight, last, user, size, turns, start, stop in columns
        for k in range(start or (size == 0), stop)  # a waiting user's first: heads
    ]
    heads += [
        (counter + 0 / weight, last, user, 0, True)
        for counter, weight, last, user, size, start, stop in zip(
            rows.counters,
            rows.weights,
            rows.lasts,
            rows.users,
            rows.sizes,
            made,
            stops,
            strict=True,
        )
        if not size and not start and stop
    ]
    rows.made = [max(start, stop) for start, stop in zip(made, stops, strict=True)]


class Scan:
    """``share_slots``' pops over the sorted entries: each slot to a running
    request, or to a waiting one while free resident places last
    (``room``). Once they are gone no slot goes to a waiting request again,
    and a user whose waiting request finds none drops out."""

    def __init__(
        self, heads: list[Entry], entries: list[Entry], slots: int, room: int
    ) -> None:
        heads.sort()
        entries.sort()
        ordered = heads + entries
        grants = list(compress(range(len(ordered)), map(_is_grant, ordered)))
        room = max(room, 0)
        counted: list[Entry] = ordered
        self.dropped: set[str] = set()
        end = len(ordered)  # where share_slots stops popping
        if len(grants) > room:
            cut = grants[room]  # the first waiting request left without room
            counted = ordered[:cut] + list(filterfalse(_is_grant, ordered[cut:]))
            if len(counted) >= slots:
                end = (
                    cut if slots <= cut else ordered.index(counted[slots - 1], cut) + 1
                )
            self.dropped = set(map(_user_of_entry, filter(_is_grant, ordered[cut:end])))
        picks = counted[:slots]
        # The last slot's entry, once every slot went; whether it is a head.
        self.last: Entry | None = picks[-1] if len(picks) == slots else None
        # (a waiting user's first slot: the only waiting one with k = 0)
        self.last_is_head = self.last is not None and self.last[3:] == (0, True)
        running = list(filterfalse(_is_grant, picks))
        # The user and k of each running request picked, in order.
        self.users: list[str] = list(map(_user_of_entry, running))
        self.ks: list[int] = list(map(_k_of_entry, running))
        self.granted = dict(Counter(map(_user_of_entry, filter(_is_grant, picks))))
        self.taken: Mapping[str, int] = Counter(map(_user_of_entry, picks))

    def behind(self, top: tuple[float, int, str]) -> bool:
        """Whether an untouched user's first slot ranks ahead of the last
        slot handed out (or not every slot went)."""
        return self.last is None or (not self.last_is_head and top < self.last[:3])


def short(rows: Rows, picked: Scan) -> list[int]:
    """Rows all of whose entries were taken, with more slots available."""
    taken, dropped = picked.taken, picked.dropped
    return [
        i
        for i, (user, made) in enumerate(zip(rows.users, rows.made, strict=True))
        if made < rows.available[i]
        and taken.get(user, 0) >= made
        and user not in dropped
    ]


def details(
    rows: Rows,
    picked: Scan,
    runs: list[int],
    unpicked: list[int],
    top: tuple[float, int, str] | None,
    protected: Mapping[str, int] | None,
    queues: Mapping[str, Sequence[Any]],
) -> tuple[Any, Any, Any]:
    """``SharedSlots``' last picks, next slots and rivals' best key, as
    ``share_slots`` leaves them (``runs``: each row's running requests
    picked; ``unpicked``: the rows that took nothing; ``top``: the best
    untouched user's first key)."""
    users = rows.users
    row_of = dict(zip(users, range(len(users)), strict=True))
    last_picks = {}
    for user in dict.fromkeys(picked.users):  # in the order first picked
        n = runs[row_of[user]]
        limit = 1 if protected is None else protected.get(user, 0)
        last_picks[user] = (n - 1, queues[user][:n], n <= limit)
    if picked.last is None:
        return last_picks, {}, None  # share_slots looks once slots run out
    taken, dropped = picked.taken, picked.dropped
    next_slots = {
        user: taken[user]
        for user, available in zip(users, rows.available, strict=True)
        if 0 < taken.get(user, 0) < available and user not in dropped
    }
    rivals = [(True, *top)] if top is not None else []
    for i in unpicked:
        turn = TURN_TOKENS if rows.turns[i] else 0
        value = rows.counters[i] + (0 - turn) / rows.weights[i]
        rivals.append((rows.sizes[i] > 0, value, rows.lasts[i], users[i]))
    if not rivals:
        return last_picks, next_slots, None
    in_queue, value, last, user = min(rivals)
    return last_picks, next_slots, ((in_queue, (1, value, last)), user)
