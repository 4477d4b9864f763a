"""Which users get their own ``user`` label on the metrics (no vLLM import).

``MetricLabels`` gives a label to the users listed by the operator,
``__anonymous__``, and at most ``recent_users`` users with recent traffic;
everyone else counts under ``OTHER_USERS``. A recent user keeps its label
until idle for ``LABEL_IDLE_S``, and a released label's series ends, so a
label never carries another user's counts. Deciding labels in the engine,
and why not in the API server: docs/architecture.md, "Statistics and the
label bound".
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_output_rate.config import ANONYMOUS_USER

OTHER_USERS = "__other__"
# A recent user keeps its label this long after its last traffic, so that
# its series does not flap; then a newly active user may take the label.
LABEL_IDLE_S = 300.0


class MetricLabels:
    """Which users get their own ``user`` label; at most
    ``len(always) + recent_users + 2`` labels exist at any time.

    A user with traffic takes a free recent slot if there is one and keeps
    it until it has been idle for ``LABEL_IDLE_S``; while every slot is
    taken, newcomers count under ``__other__`` (no churn of series).
    """

    def __init__(self, always: Iterable[str], recent_users: int) -> None:
        self.always = frozenset(always)
        self.recent_users = recent_users
        self.recent: dict[str, None] = {}  # the users holding a recent slot

    def label_of(self, user: str) -> str:
        """The user's label, taking a free recent slot if it has none."""
        label = self.current_label(user)
        if label == OTHER_USERS and len(self.recent) < self.recent_users:
            self.recent[user] = None
            return user
        return label

    def current_label(self, user: str) -> str:
        """The user's label now (read-only)."""
        if user in self.always or user == ANONYMOUS_USER or user in self.recent:
            return user
        return OTHER_USERS

    def release(self, users: Iterable[str]) -> None:
        for user in users:
            self.recent.pop(user, None)
