"""The window in which a saturated engine's shares can be judged.

A share is owed only to a user that is backlogged. From the engine's
dispatch log alone, a user whose requests ended and whose next request has
not reached the engine yet looks the same as one the scheduler holds; both
e2e tests and benchmarks therefore judge shares only between the moment
every user was being served (plus a settling time) and the first moment one
of them got its last token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from harness.bounds import S


def served_window(
    dispatched: Mapping[str, Sequence[int]],
    users: Sequence[str],
    start_ns: int,
    end_ns: int,
    settle_ns: int = S,
) -> tuple[int, int]:
    """The part of ``[start_ns, end_ns]`` from ``settle_ns`` after the last
    user's first dispatch to the first user's last dispatch.

    A user with no dispatch in ``[start_ns, end_ns]`` leaves the window whole:
    its share is then 0, which is what a judge must see. The result can be
    empty (begin > end) when the users were never served together.
    """
    times = {
        user: [t for t in dispatched.get(user, ()) if start_ns <= t <= end_ns]
        for user in users
    }
    if not all(times.values()):
        return start_ns, end_ns
    begin = max(start_ns, max(ts[0] for ts in times.values()) + settle_ns)
    end = min([end_ns, *(ts[-1] for ts in times.values())])
    return begin, end
