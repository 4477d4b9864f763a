"""Each step's demand and what the step sampled, per user (no vLLM import).

A request samples at most one token per step, so a user's unfinished
requests bound what it can take in a step: that count is the step's demand.
It is kept up to date from the requests added and vLLM's ids of the requests
finished since the last step, O(finished) rather than O(requests): a pass
over thousands of cache-cold requests showed in the step time.

``FirstTokens`` keeps the requests still waiting for their first token, to
time it (arrival in the scheduler to the step that samples it).

Requests are vLLM ``Request`` objects, read only through the attributes
named here (the user this plugin tags them with, ``is_prefill_chunk``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from itertools import filterfalse
from operator import attrgetter
from typing import Any

# Per-request attributes this plugin keeps on vLLM's Request objects (under
# its own prefix, so that they cannot collide with vLLM's).
USER_ATTR = "output_rate_user"
LAST_SERVED_ATTR = "output_rate_last_served_step"

# For map() and filter(): the per-request passes then run in C, without a
# Python call per request.
user_of = attrgetter(USER_ATTR)
last_served_of = attrgetter(LAST_SERVED_ATTR)
_is_prefill_chunk = attrgetter("is_prefill_chunk")


class Demand:
    """Unfinished requests per user, kept without a pass over the requests."""

    def __init__(self) -> None:
        # Each unfinished request's user, and their count per user.
        self.user_by_id: dict[str, str] = {}
        # A plain dict, not a Counter: Counter's == is a Python-level method,
        # and this one is compared every step.
        self.unfinished: dict[str, int] = {}
        # Changes whenever a user joins or leaves ``unfinished``, so that a
        # watcher (a shared store's leases) need not compare the users.
        self.generation = 0
        # Changes whenever a count in ``unfinished`` changes.
        self.changes = 0

    def add(self, request_id: str, user: str) -> None:
        if request_id not in self.user_by_id:
            self.user_by_id[request_id] = user
            self.changes += 1
            count = self.unfinished.get(user, 0)
            self.unfinished[user] = count + 1
            if not count:
                self.generation += 1

    def count_unfinished(
        self, finished_ids: Iterable[str], requests: Mapping[str, Any]
    ) -> dict[str, int]:
        """Unfinished requests per user, after the requests in ``finished_ids``
        left. ``requests`` is vLLM's map of every unfinished request.

        Every request enters through ``add``, so the map can only hold too
        many ids, never too few; equal sizes mean it is exact, and otherwise
        (a request left some other way) it is rebuilt from ``requests``.
        """
        users, unfinished = self.user_by_id, self.unfinished
        for request_id in finished_ids:
            user = users.pop(request_id, None)
            if user is not None:
                self.changes += 1
                unfinished[user] -= 1
                if not unfinished[user]:
                    del unfinished[user]
                    self.generation += 1
        if len(users) != len(requests):
            self.recount(requests)
        return self.unfinished

    def recount(self, requests: Mapping[str, Any]) -> None:
        self.user_by_id = {rid: user_of(r) for rid, r in requests.items()}
        self.unfinished = dict(Counter(self.user_by_id.values()))
        self.generation += 1
        self.changes += 1

    def count_sampled(
        self,
        scheduled: Mapping[str, int],
        inflight_prefills: Collection[Any],
        requests: Mapping[str, Any],
    ) -> Mapping[str, int]:
        """Sampled tokens per user among the requests ``scheduled`` in a step
        (read-only: it may be the live count of unfinished requests).

        A chunk that did not reach the end of the sequence samples nothing.
        vLLM keeps such requests in ``inflight_prefills`` until their last
        chunk; when it is empty (steady decoding), every scheduled request
        sampled and the count needs only request ids, not a touch of each
        (cache-cold) request. Otherwise each scheduled request's
        ``is_prefill_chunk``, set by vLLM after scheduling, decides: the same
        test the scheduler's hook applies before dispatch.
        """
        if not inflight_prefills:
            if len(scheduled) == len(self.user_by_id):
                # Every unfinished request was scheduled (the map is exact
                # after count_unfinished): each user sampled its demand.
                return self.unfinished
            try:
                return Counter(map(self.user_by_id.__getitem__, scheduled))
            except KeyError:
                pass  # a request the map does not know: look at each one
        return Counter(
            map(
                user_of,
                filterfalse(_is_prefill_chunk, map(requests.__getitem__, scheduled)),
            )
        )


class FirstTokens:
    """Requests waiting for their first token: (user, arrival ns) by id.

    A step's check costs nothing while none waits, and otherwise one C-level
    intersection of the waiting ids with the step's scheduled ids plus a look
    at the (few) requests in both.
    """

    def __init__(self) -> None:
        self.waiting: dict[str, tuple[str, int]] = {}

    def add(self, request_id: str, user: str, arrival_ns: int) -> None:
        self.waiting.setdefault(request_id, (user, arrival_ns))

    def sampled(
        self, scheduled: Mapping[str, int], requests: Mapping[str, Any]
    ) -> list[tuple[str, int]]:
        """(user, arrival ns) of each waiting request whose first token the
        step sampled: scheduled with a chunk that reached the sequence end
        (``is_prefill_chunk`` false, set by vLLM after scheduling)."""
        if not self.waiting:
            return []
        firsts = []
        for request_id in self.waiting.keys() & scheduled.keys():
            request = requests.get(request_id)
            if request is not None and not _is_prefill_chunk(request):
                firsts.append(self.waiting.pop(request_id))
        return firsts

    def forget_finished(self, requests: Mapping[str, Any]) -> None:
        """Drop requests that finished (or were aborted) before sampling."""
        if len(self.waiting) > 0:
            self.waiting = {
                rid: entry for rid, entry in self.waiting.items() if rid in requests
            }
