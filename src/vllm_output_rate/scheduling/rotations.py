"""Each user's running requests in rotation, between contested steps (no vLLM import).

``Rotations.rank`` hands a contested step's active slots out as
``ordering.share_slots`` does (the same running order, grants and
``SharedSlots``) in steps where every user is covered (no request goes last
for lack of budget), FCFS and without floors: the caller checks that. Its
work follows what changed since the step it last ranked or kept (the users
touched: served, finishing, admitted or claiming), not what is resident,
and it reads no request that step did not schedule. Requests are opaque
(``user_of``, ``last_served_of``, ``id_of``). How it keeps the users not
touched, and why it ranks as ``share_slots`` does: docs/architecture.md,
"Rotations".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import add, getitem, mul, not_
from typing import Any, Generic, TypeVar

from vllm_output_rate.scheduling import slot_scan
from vllm_output_rate.scheduling.fair_share import FairShare
from vllm_output_rate.scheduling.ordering import SharedSlots, weighted_shares
from vllm_output_rate.scheduling.slot_scan import Entry, Rows, Scan, make_entries
from vllm_output_rate.scheduling.untouched import Untouched

R = TypeVar("R")
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
        # Users not picked and not touched since, by their first slot's key.
        self._untouched = Untouched()
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
        self._untouched.lift(level)
        queues = self.queues
        touched = self._touched.union(waiting)
        self._touched = set()
        self._untouched.discard(touched)
        rows = Rows()
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
        make_entries(rows, hints, entries, heads)
        picked = Scan(heads, entries, slots, room)
        # Untouched users, while one ranks ahead of the last slot handed out
        # (that slot only moves up as entries are added: one pass).
        popped = []
        while (top := self._untouched.top(level)) is not None and picked.behind(top):
            popped.append(self._untouched.pop())
        if popped:
            first = len(rows.users)
            self._add_rows(rows, popped, {}, step, fair, user_last_served)
            spare = chain(rows.made[:first], repeat(SPARE_ENTRIES))
            make_entries(rows, spare, entries, heads)
            picked = Scan(heads, entries, slots, room)
        # A user all of whose entries so far were taken may take more.
        while more := set(slot_scan.short(rows, picked)):
            doubled = [n * 2 + 1 if i in more else n for i, n in enumerate(rows.made)]
            make_entries(rows, doubled, entries, heads)
            picked = Scan(heads, entries, slots, room)
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
        rows: Rows,
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

    def _protected(self, rows: Rows, slots: int, fair: FairShare) -> dict[str, int]:
        available = self.resident()
        available.update(zip(rows.users, rows.available, strict=True))
        shares = weighted_shares(slots, available, fair.weight)
        return {user: math.ceil(share) for user, share in shares.items()}

    # ----- the step's outcome -------------------------------------------------

    def _result(
        self,
        rows: Rows,
        picked: Scan,
        protected: Mapping[str, int] | None,
        slots: int,
        fair: FairShare,
    ) -> SharedSlots[R]:
        """The ranking as ``share_slots`` returns it; the rows not picked to
        the heaps."""
        users, queues, level = rows.users, self.queues, fair.level
        taken_by, dropped = picked.taken, picked.dropped
        top = self._untouched.top(level) if picked.last is not None else None
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
                    self._untouched.push(user, rows.counters[i], level, rows.lasts[i])
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
            details = slot_scan.details(
                rows, picked, runs, unpicked, top, protected, self.queues
            )
        return SharedSlots(batch + deferred, picked.granted, *details)

    def _rotate(self, user: str, turns: int) -> None:
        """Its requests in turn, not served now, go behind the others."""
        queue, served = self.queues[user], self._served[user]
        self.queues[user] = [*queue[turns:], *queue[:turns]]
        self._served[user] = [*served[turns:], *served[:turns]]
