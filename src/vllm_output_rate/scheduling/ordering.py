"""Who goes first among resident requests (no vLLM import).

Both functions return a new order and leave their input untouched. Requests
are opaque; callers pass functions that read a request's user, priority and
the scheduler step at which it last received an output token.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import chain, zip_longest
from typing import TypeVar

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


def fair_order(
    requests: Sequence[R],
    user_of: Callable[[R], str],
    last_served_of: Callable[[R], int],
    user_last_served: Mapping[str, int],
    priority_of: Callable[[R], int] | None = None,
) -> list[R]:
    """Order requests so that a limited number of active slots goes round-robin.

    Users take turns, the user served least recently first; each user's
    streams take turns too. With ``priority_of``, a lower priority value is
    served first (vLLM's convention) and fairness applies within a priority.
    """
    classes: dict[int, dict[str, list[R]]] = {}
    for request in requests:
        priority = priority_of(request) if priority_of else 0
        classes.setdefault(priority, {}).setdefault(user_of(request), []).append(
            request
        )
    ordered: list[R] = []
    for priority in sorted(classes):
        users = classes[priority]
        queues = [
            sorted(users[user], key=last_served_of)
            for user in sorted(users, key=lambda u: user_last_served.get(u, -1))
        ]
        turns = chain.from_iterable(zip_longest(*queues))
        ordered.extend(request for request in turns if request is not None)
    return ordered
