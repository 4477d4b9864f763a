"""Each user's requests in one API server, counted from vLLM's own output
processor: a request is in flight while vLLM tracks it (sequences of ``n``
each, dropped when vLLM drops them: finished or aborted), plus the places
admitted and not registered yet (reservations)."""

from __future__ import annotations

from typing import Any


class Ledger:
    """Each user's requests in this API server, counted from vLLM's own
    output processor (a request is in flight while vLLM tracks it)."""

    def __init__(self, output_processor: Any) -> None:
        self._states: dict[str, Any] = output_processor.request_states
        self._parents: dict[str, Any] = output_processor.parent_requests
        self.entries: dict[str, dict[str, int]] = {}  # user -> {id: n}
        # Admitted, not registered yet (counted against the caps meanwhile).
        self.reserved: dict[str, int] = {}
        self.reserved_total = 0

    def reserve(self, user: str, n: int) -> None:
        self.reserved[user] = self.reserved.get(user, 0) + n
        self.reserved_total += n

    def release(self, user: str, n: int) -> None:
        held = self.reserved.get(user, 0)
        self.reserved_total -= min(n, held)
        if held > n:
            self.reserved[user] = held - n
        else:
            self.reserved.pop(user, None)

    def register(self, user: str, request_id: str, n: int) -> None:
        self.entries.setdefault(user, {})[request_id] = n

    def _live(self, request_id: str, n: int) -> list[Any]:
        """The vLLM request states of one entry still in flight."""
        if n == 1:
            state = self._states.get(request_id)
            return [] if state is None else [state]
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [s for c in parent.child_requests if (s := self._states.get(c))]

    def in_flight(self, user: str) -> int:
        """The user's registered sequences in flight (finished ones dropped)."""
        entries = self.entries.get(user)
        if not entries:
            return 0
        count = 0
        for request_id, n in list(entries.items()):
            live = len(self._live(request_id, n))
            if live:
                count += live
            else:
                del entries[request_id]
        if not entries:
            del self.entries[user]
        return count

    def requests(self, user: str) -> int:
        return self.in_flight(user) + self.reserved.get(user, 0)

    def queued_tokens(self, user: str) -> int:
        """Prompt tokens of the user's requests still in prefill (as vLLM
        counts them for its own token cap)."""
        return sum(
            state.prompt_len
            for request_id, n in list(self.entries.get(user, {}).items())
            for state in self._live(request_id, n)
            if state.is_prefilling
        )

    def users(self) -> list[str]:
        return list(self.entries.keys() | self.reserved.keys())

    def live_users(self) -> list[str]:
        """Users with requests in flight or places reserved, dropping every
        finished request (run periodically: a user that never comes back
        leaves no entry behind)."""
        for user in list(self.entries):
            self.in_flight(user)
        return self.users()
