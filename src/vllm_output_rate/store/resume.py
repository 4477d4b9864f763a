"""After serving without the store: fallback shares held for a lease period (pure).

An engine that served its users at their fallback share (the store
unreachable for a whole lease period) and gets its first answer again keeps
each of those users at most at that share for one more lease period
(``ResumeCaps.usable``), and asks for no more than that (``cap``: the
store then leaves the rest of the limit to the other engines at once, not
after this engine's grace); users it did not serve at a fallback share are
not held. Why: the other engines get their first answers each at its own time,
and a store that restarted counts nothing for an engine that has not asked
yet, so it may grant the first engine to ask a user's whole limit while the
others still serve their fallback shares (docs/architecture.md, "When the
store fails").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ResumeCaps:
    """Users' fallback shares, held until ``until_ns`` (local clock)."""

    caps: dict[str, float] = field(default_factory=dict)
    until_ns: int = 0

    def begin(self, caps: dict[str, float], until_ns: int) -> None:
        self.caps, self.until_ns = dict(caps), until_ns

    def holds(self, user: str, now: int) -> bool:
        """Whether ``user`` is still held to its fallback share."""
        if self.caps and now >= self.until_ns:
            self.caps.clear()
        return user in self.caps

    def cap(self, user: str, now: int) -> float | None:
        """``user``'s fallback share while it is held to it, else None."""
        return self.caps[user] if self.holds(user, now) else None

    def usable(self, user: str, rate: float, now: int) -> float:
        """What the pacer may use of a granted ``rate``."""
        return min(rate, self.caps[user]) if self.holds(user, now) else rate
