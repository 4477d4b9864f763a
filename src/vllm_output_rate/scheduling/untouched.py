"""Users whose slot keys did not change since they were last ranked (no vLLM import).

``Untouched`` holds the users a ranking by the rotations (``rotations.py``)
did not pick and that nothing has touched since: their counters, weights
and last service are as they were, and none of their requests is in its
turn, so their first slot's key is ``max(counter, level)``; only the level
moves. They wait in two heaps: at or below the level (all tied at it, by
last service, then name) and above it (by counter, last service, name);
when the level rises, those it reaches move to the first. ``top`` is the
first slot's key of the best of them, as ``share_slots`` would rank it.
A user is taken out by ``pop`` (the best) or ``discard`` (any: a stale
entry stays in its heap, known by its token, and is dropped when met).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class Untouched:
    def __init__(self) -> None:
        self._at_level: list[tuple[int, str, int]] = []  # (served, user, token)
        self._above: list[tuple[float, int, str, int]] = []  # (counter, ...)
        self._tokens: dict[str, int] = {}  # user -> its live entry's token
        self._next_token = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def push(self, user: str, counter: float, level: float, last_served: int) -> None:
        """Add ``user``, whose counter as the ranking reads it is ``counter``."""
        token = self._tokens[user] = self._next_token
        self._next_token += 1
        if counter > level:
            heapq.heappush(self._above, (counter, last_served, user, token))
        else:
            heapq.heappush(self._at_level, (last_served, user, token))

    def discard(self, users: Iterable[str]) -> None:
        """Take ``users`` out (they were touched)."""
        tokens = self._tokens
        for user in users:
            tokens.pop(user, None)

    def lift(self, level: float) -> None:
        """The level rose to ``level``: move the users it reached."""
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

    def top(self, level: float) -> tuple[float, int, str] | None:
        """The best user's first slot key (``slot_scan.Entry[:3]``), with no
        turn: ``counter + 0 / weight``, as ``FairShare.key`` computes it."""
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

    def pop(self) -> str:
        """Take the best user out (after ``top``, which dropped stale entries)."""
        if self._at_level:
            user = heapq.heappop(self._at_level)[1]
        else:
            user = heapq.heappop(self._above)[2]
        del self._tokens[user]
        return user
