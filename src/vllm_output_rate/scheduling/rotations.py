"""Each user's running requests in rotation, between contested steps (no vLLM import).

``Rotations.rank`` hands a contested step's active slots out as
``ordering.share_slots`` does (the same running order, grants and
``SharedSlots``) in steps where every user is covered (no request goes last
for lack of budget), FCFS and without floors: the caller checks that. Its
work follows what changed since the step it last ranked or kept, not what
is resident, and it reads no request that step did not schedule:

* each user's requests are kept in the order the ranking reads them (its
  rotation), with the step each was last served in, and sorted again only
  for the users *touched*: scheduled in the last step, with a request
  finished or admitted, or claiming slots for waiting requests;
* the other users wait in two heaps keyed by their first slot's rank (at
  and above the level: untouched, only the level moves them), taken from
  the top only while they rank ahead of the last slot handed out;
* the slots go to the lowest keys, in one sort of the candidates' keys, and
  vLLM's running list is rebuilt from per-user slices.

Requests are opaque (``user_of``, ``last_served_of``, ``id_of``). Why this
ranks as ``share_slots`` does: docs/architecture.md, "Rotations".
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain, compress, filterfalse, repeat
from operator import add, getitem, itemgetter, mul, not_
from typing import Any, Generic, TypeVar

from vllm_output_rate.scheduling.fair_share import TURN_TOKENS, FairShare
from vllm_output_rate.scheduling.ordering import SharedSlots, weighted_shares

R = TypeVar("R")
# A slot's rank as share_slots' heap orders it, less what entries here do
# not differ in (in_queue: true but for a waiting user's first slot, kept
# apart; the floor flag: no floors), then the slot's k and whether it is for
# a waiting request: (counter + (k - turn) / weight, last served, user, k,
# waiting). A user's k differ, so no two entries tie.
Entry = tuple[float, int, str, int, bool]
_user_of_entry, _k_of_entry, _is_grant = itemgetter(2), itemgetter(3), itemgetter(4)
# Entries made at first for a user beyond the slots it took last time.
SPARE_ENTRIES = 2
# The ranking's details for kept_batch (last picks, next slots, rivals) are
# made for batches of at most this many users (shortcuts.py).
DETAILED_USERS = 32


class _Layout:
    """The running list as a ranking laid it out: the batch (its users, one
    per request), each user's deferred requests in ``order``, then the
    requests admitted during the step (their users)."""

    def __init__(
        self,
        batch_users: list[str],
        order: list[str],
        rests: list[Sequence[Any]],
        admitted_users: list[str],
    ) -> None:
        self.batch_users = batch_users
        self.order = order
        self.rests = rests
        self.admitted_users = admitted_users

    def size(self) -> int:
        """Requests in the list but the admitted ones."""
        return len(self.batch_users) + sum(map(len, self.rests))

    def users_by_place(self) -> list[str]:
        """Each place's user, in list order."""
        deferred = [
            user
            for user, rest in zip(self.order, self.rests, strict=True)
            for _ in rest
        ]
        return self.batch_users + deferred + self.admitted_users


class _Rows:
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


class Rotations(Generic[R]):
    def __init__(
        self,
        user_of: Callable[[R], str],
        last_served_of: Callable[[R], int],
        id_of: Callable[[R], str],
    ) -> None:
        self._user_of = user_of
        self._last_served_of = last_served_of
        self._id_of = id_of
        self.forget()

    def forget(self) -> None:
        """Follow nothing: the next step starts from its running list."""
        # user -> its running requests, and the step each was last served
        # in (lists replaced, never changed in place: slices are shared).
        self.queues: dict[str, Sequence[R]] = {}
        self._served: dict[str, Sequence[int]] = {}
        self._by_id: dict[str, R] = {}
        self._touched: set[str] = set()
        # Untouched users by their first slot's rank: (last served, user,
        # token) at the level, (counter, last served, user, token) above it.
        self._at_level: list[tuple[int, str, int]] = []
        self._above: list[tuple[float, int, str, int]] = []
        self._tokens: dict[str, int] = {}
        self._next_token = 0
        # The running list the next step should find, as the last ranking
        # laid it out (the batch's users, the deferred requests by user, the
        # users admitted); that step's number, the step ``resume`` accepted
        # and the users in order of their first place in the list.
        self._expected: list[R] | None = None
        self._layout = _Layout([], [], [], [])
        self._next_step = -1
        self._resumed = -1
        self._user_order: list[str] = []
        # The last ranking: running picks and slots taken per user, its
        # batch, whether the step just settled was ranked (not kept).
        self._runs: dict[str, int] = {}
        self._taken: Mapping[str, int] = {}
        self._batch: list[R] = []
        self._ranked_now = False
        # Users with a running request deferred by the last ranking, and
        # whether it made the details kept_batch reads.
        self.deferred_users: list[str] = []
        self.detailed = False

    # ----- between steps ------------------------------------------------------

    def resume(self, step: int, running: list[R], finished_ids: Iterable[str]) -> bool:
        """Follow the requests that finished since the last step; whether
        ``running`` is then the list that step left (else ``rank`` rebuilds)."""
        if self._expected is None or step != self._next_step:
            return False
        gone = [r for rid in finished_ids if (r := self._by_id.pop(rid, None))]
        for request in gone:
            user = self._user_of(request)
            queue, served = self.queues[user], self._served[user]
            i = next(i for i, r in enumerate(queue) if r is request)
            if len(queue) > 1:
                self.queues[user] = [*queue[:i], *queue[i + 1 :]]
                self._served[user] = [*served[:i], *served[i + 1 :]]
            else:
                del self.queues[user], self._served[user]
            self._touched.add(user)
        layout = self._layout
        places: Iterable[str]
        if gone:
            ids = set(map(id, gone))
            keep = list(map(not_, map(ids.__contains__, map(id, self._expected))))
            self._expected = list(compress(self._expected, keep))
            places = compress(layout.users_by_place(), keep)
        else:  # each user's first place: the deferred ones' blocks are whole
            deferred = compress(layout.order, layout.rests)
            places = chain(layout.batch_users, deferred, layout.admitted_users)
        if running != self._expected:
            return False
        self._user_order = list(dict.fromkeys(places))
        self._resumed = step
        return True

    def resident(self) -> dict[str, int]:
        """Running requests per user (after ``resume``)."""
        return dict(zip(self.queues, map(len, self.queues.values()), strict=True))

    def settled(
        self,
        step: int,
        running: list[R],
        scheduled: Mapping[str, int],
        *,
        preempted: bool,
        sampled_all: bool,
        set_aside: bool,
    ) -> None:
        """After a step this object ranked, or a kept step that followed it:
        ``running`` as vLLM left it (requests set aside back), what it
        scheduled, whether it preempted any, whether every request it
        scheduled sampled (no prefill continues), whether the requests
        beyond the batch were set aside for it."""
        ranked, self._ranked_now = self._ranked_now, False
        if preempted or (not ranked and self._next_step != step):
            self.forget()
            return
        known = self._layout.size() if ranked else len(running)
        if not ranked and known != len(self._expected or ()):
            self.forget()  # a kept step admits nothing
            return
        admitted = running[known:]
        by_id = self._by_id
        if set_aside and len(scheduled) == len(self._batch) + len(admitted):
            # vLLM saw the batch alone (the running list starts with it) and
            # scheduled all of it.
            all_picks = True
        else:
            # Of the running requests only picks may have been scheduled
            # (else vLLM passed a pick over and another took its slot).
            picks = set(map(id, self._batch))
            known_ids = scheduled.keys() & by_id
            scheduled_picks = set(map(id, map(by_id.__getitem__, known_ids)))
            if not scheduled_picks <= picks:
                self.forget()
                return
            all_picks = len(scheduled_picks) == len(picks)
        users, runs = list(self._runs), list(self._runs.values())
        if sampled_all and all_picks:
            # Every pick was served now (and is in its turn next step).
            fresh: Iterable[list[int]] = map(mul, repeat([step]), runs)
        else:
            last_served_of, queues = self._last_served_of, self.queues
            fresh = (
                [*map(last_served_of, queues[u][:n])]
                for u, n in zip(users, runs, strict=True)
            )
        served = self._served
        tails = map(
            getitem, map(served.__getitem__, users), map(slice, runs, repeat(None))
        )
        served.update(zip(users, map(add, fresh, tails), strict=True))
        admitted_users = list(map(self._user_of, admitted))
        for user, request in zip(admitted_users, admitted, strict=True):
            self.queues[user] = [*self.queues.get(user, ()), request]
            served[user] = [*served.get(user, ()), self._last_served_of(request)]
            by_id[self._id_of(request)] = request
        self._touched.update(users, admitted_users)
        if ranked:
            self._layout.admitted_users = admitted_users
        self._expected = list(running)
        self._next_step = step + 1

    # ----- a step -----------------------------------------------------------

    def rank(
        self,
        *,
        step: int,
        running: list[R],
        waiting: Mapping[str, int],
        slots: int,
        room: int,
        fair: FairShare,
        user_last_served: Mapping[str, int],
    ) -> SharedSlots[R]:
        """``share_slots`` for ``running`` (every request covered), with
        ``waiting``, ``slots`` and ``room`` as there."""
        if self._resumed != step:
            self._rebuild(running)
        level = fair.level
        self._lift(level)
        queues = self.queues
        touched = self._touched.union(waiting)
        self._touched = set()
        deque(map(self._tokens.pop, touched, repeat(None)), 0)  # out of the heaps
        rows = _Rows()
        # In the last ranking's order first: their keys come out nearly
        # sorted, which the sort then takes in about one pass.
        ranked_first = dict.fromkeys(chain(self._layout.batch_users, touched))
        touched_users = [
            u for u in ranked_first if u in touched and (u in queues or waiting.get(u))
        ]
        self._add_rows(rows, touched_users, waiting, step, fair, user_last_served)
        protected: dict[str, int] | None = None
        if max(rows.in_turn, default=0) > 1:
            # Turns count within the weighted share of the slots
            # (share_slots): that can only matter to two or more in turn.
            protected = self._protected(rows, slots, fair)
            rows.turns = list(
                map(min, rows.in_turn, map(protected.get, rows.users, repeat(0)))
            )
        entries: list[Entry] = []
        heads: list[Entry] = []  # waiting users' first slots: ahead of all
        taken_before = self._taken
        hints = [taken_before.get(u, 0) + SPARE_ENTRIES for u in rows.users]
        _make(rows, hints, entries, heads)
        picked = _Scan(heads, entries, slots, room)
        # Untouched users, while one ranks ahead of the last slot handed out
        # (that slot only moves up as entries are added: one pass).
        popped = []
        while (top := self._top(level)) is not None and picked.behind(top):
            popped.append(top[2])
            self._pop_top()
        if popped:
            first = len(rows.users)
            self._add_rows(rows, popped, {}, step, fair, user_last_served)
            targets = chain(rows.made[:first], repeat(SPARE_ENTRIES))
            _make(rows, targets, entries, heads)
            picked = _Scan(heads, entries, slots, room)
        # A user all of whose entries so far were taken may take more.
        while short := set(self._short(rows, picked)):
            targets = [n * 2 + 1 if i in short else n for i, n in enumerate(rows.made)]
            _make(rows, targets, entries, heads)
            picked = _Scan(heads, entries, slots, room)
        return self._result(rows, picked, protected, slots, fair)

    def _rebuild(self, running: list[R]) -> None:
        self.forget()
        queues: dict[str, list[R]] = {}
        for request in running:
            queues.setdefault(self._user_of(request), []).append(request)
            self._by_id[self._id_of(request)] = request
        for user, queue in queues.items():
            self.queues[user] = queue
            self._served[user] = list(map(self._last_served_of, queue))
        self._user_order = list(queues)
        self._touched = set(queues)

    def _add_rows(
        self,
        rows: _Rows,
        users: list[str],
        waiting: Mapping[str, int],
        step: int,
        fair: FairShare,
        user_last_served: Mapping[str, int],
    ) -> None:
        """Sort the users' queues for ``step`` and add their rows."""
        queues, served_of, waiting_of = self.queues, self._served, waiting.get
        previous = step - 1
        sizes, in_turn, available = [], [], []
        for user in users:
            size = len(queues.get(user, ()))
            if size > 1:
                turn = self._sort(user, step)
            else:  # served in the last step: in its turn
                turn = int(size > 0 and served_of[user][0] == previous)
            sizes.append(size)
            in_turn.append(turn)
            available.append(size + waiting_of(user, 0))
        rows.users += users
        rows.sizes += sizes
        rows.in_turn += in_turn
        rows.turns += in_turn
        rows.available += available
        rows.made += repeat(0, len(users))
        rows.counters += fair.services(users)
        rows.weights += fair.weights_of(users)
        rows.lasts += map(user_last_served.get, users, repeat(-1))

    def _sort(self, user: str, step: int) -> int:
        """Sort ``user``'s queue as ``share_slots`` does: served in the last
        step (in turn) first, then least recently served, ties in running
        order (the last step served is the latest any can have). Returns
        how many are in turn."""
        queue, served = self.queues[user], self._served[user]
        in_turn = served.count(step - 1)
        rest = served[in_turn:]
        if served[:in_turn] == [step - 1] * in_turn and rest == sorted(rest):
            return in_turn  # in that order already (the usual case)
        order = sorted(range(len(served)), key=served.__getitem__)
        if in_turn:
            order = order[-in_turn:] + order[:-in_turn]
        self.queues[user] = list(map(queue.__getitem__, order))
        self._served[user] = list(map(served.__getitem__, order))
        return in_turn

    def _protected(self, rows: _Rows, slots: int, fair: FairShare) -> dict[str, int]:
        available = self.resident()
        available.update(zip(rows.users, rows.available, strict=True))
        shares = weighted_shares(slots, available, fair.weight)
        return {user: math.ceil(share) for user, share in shares.items()}

    def _short(self, rows: _Rows, picked: _Scan) -> list[int]:
        """Rows all of whose entries were taken, with more slots available."""
        taken, dropped = picked.taken, picked.dropped
        return [
            i
            for i, (user, made) in enumerate(zip(rows.users, rows.made, strict=True))
            if made < rows.available[i]
            and taken.get(user, 0) >= made
            and user not in dropped
        ]

    # ----- the heaps of untouched users --------------------------------------

    def _push(self, user: str, counter: float, level: float, last_served: int) -> None:
        token = self._tokens[user] = self._next_token
        self._next_token += 1
        if counter > level:
            heapq.heappush(self._above, (counter, last_served, user, token))
        else:
            heapq.heappush(self._at_level, (last_served, user, token))

    def _lift(self, level: float) -> None:
        """Move the users the level has reached to the level's heap."""
        above, tokens = self._above, self._tokens
        while above and above[0][0] <= level:
            _, last_served, user, token = heapq.heappop(above)
            if tokens.get(user) == token:
                heapq.heappush(self._at_level, (last_served, user, token))
        if len(self._at_level) + len(above) > 2 * len(tokens) + 64:
            self._at_level = [e for e in self._at_level if tokens.get(e[1]) == e[2]]
            self._above = [e for e in above if tokens.get(e[2]) == e[3]]
            heapq.heapify(self._at_level)
            heapq.heapify(self._above)

    def _top(self, level: float) -> tuple[float, int, str] | None:
        """The best untouched user's first entry (as ``Entry[:3]``: no turn
        counts for it, so its key is ``counter + 0 / weight``)."""
        tokens, at_level, above = self._tokens, self._at_level, self._above
        while at_level and tokens.get(at_level[0][1]) != at_level[0][2]:
            heapq.heappop(at_level)
        if at_level:
            last_served, user, _ = at_level[0]
            return (level + 0.0, last_served, user)
        while above and tokens.get(above[0][2]) != above[0][3]:
            heapq.heappop(above)
        if above:
            counter, last_served, user, _ = above[0]
            return (counter + 0.0, last_served, user)
        return None

    def _pop_top(self) -> None:
        heap: list[Any] = self._at_level if self._at_level else self._above
        del self._tokens[heapq.heappop(heap)[-2]]

    # ----- the step's outcome -------------------------------------------------

    def _result(
        self,
        rows: _Rows,
        picked: _Scan,
        protected: Mapping[str, int] | None,
        slots: int,
        fair: FairShare,
    ) -> SharedSlots[R]:
        """The ranking as ``share_slots`` returns it; the rows not picked to
        the heaps."""
        users, queues, level = rows.users, self.queues, fair.level
        taken_by, dropped = picked.taken, picked.dropped
        top = self._top(level) if picked.last is not None else None
        runs: list[int] = []
        self._runs = {}
        cut: dict[str, Sequence[R]] = {}  # what is left of the picked users'
        unpicked = []
        for i, (user, size) in enumerate(zip(users, rows.sizes, strict=True)):
            taken = taken_by.get(user, 0)
            n = taken if taken < size else size
            runs.append(n)
            if n:
                self._runs[user] = n
                cut[user] = queues[user][n:] if n < size else ()
            elif not taken and user not in dropped:
                unpicked.append(i)
                if size:
                    self._push(user, rows.counters[i], level, rows.lasts[i])
        order = self._user_order
        rests = list(map(cut.get, order, map(queues.__getitem__, order)))
        for i in unpicked:
            if rows.in_turn[i]:  # not served now: its turn passes (next step)
                self._rotate(users[i], rows.in_turn[i])
        self._taken = picked.taken
        batch = list(map(getitem, map(queues.__getitem__, picked.users), picked.ks))
        # The deferred requests, by their users' first place in the list.
        deferred = list(chain.from_iterable(rests))
        self.deferred_users = list(compress(order, rests))
        self._batch = batch
        self._layout = _Layout(picked.users, order, rests, [])
        self._ranked_now = True
        details: tuple[Any, Any, Any] = ({}, {}, None)
        self.detailed = len(self._runs) <= DETAILED_USERS
        if self.detailed:
            if protected is None and max(runs, default=0) > 1:
                protected = self._protected(rows, slots, fair)
            details = self._details(rows, picked, runs, unpicked, top, protected)
        return SharedSlots(batch + deferred, picked.granted, *details)

    def _details(
        self,
        rows: _Rows,
        picked: _Scan,
        runs: list[int],
        unpicked: list[int],
        top: tuple[float, int, str] | None,
        protected: Mapping[str, int] | None,
    ) -> tuple[Any, Any, Any]:
        """``SharedSlots``' last picks, next slots and rivals' best key."""
        users = rows.users
        row_of = dict(zip(users, range(len(users)), strict=True))
        last_picks = {}
        for user in dict.fromkeys(picked.users):  # in the order first picked
            n = runs[row_of[user]]
            limit = 1 if protected is None else protected.get(user, 0)
            last_picks[user] = (n - 1, self.queues[user][:n], n <= limit)
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

    def _rotate(self, user: str, turns: int) -> None:
        """Its requests in turn, not served now, go behind the others."""
        queue, served = self.queues[user], self._served[user]
        self.queues[user] = [*queue[turns:], *queue[:turns]]
        self._served[user] = [*served[turns:], *served[:turns]]


def _make(
    rows: _Rows, targets: Iterable[int], entries: list[Entry], heads: list[Entry]
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


class _Scan:
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
