"""Rates as exact fractions, with times scaled so that intervals are integers.

A rate is the fraction ``p / q`` tokens per second of the shortest decimal
that names the float (2.5 is 5/2, 0.1 is 1/10; integer rates have
``q == 1``). A limiter stores every time of a user multiplied by ``p``,
which turns the interval ``q / p`` seconds into the integer ``q × 10⁹``
scaled nanoseconds: nothing rounds while tokens are taken, so there is no
drift over millions of tokens. Pure Python, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

NS_PER_SECOND = 1_000_000_000


@dataclass(frozen=True, slots=True)
class ScaledRate:
    """A rate ``p / q`` tok/s with every duration pre-multiplied by ``p``."""

    scale: int  # p: clock readings are multiplied by this
    interval: int  # q * 1e9: one token's spacing, in scaled nanoseconds
    burst: int  # burst_ns * p

    @classmethod
    def from_rate(cls, rate: float, burst_ns: int) -> ScaledRate:
        fraction = Fraction(repr(rate))
        p, q = fraction.numerator, fraction.denominator
        return cls(scale=p, interval=q * NS_PER_SECOND, burst=burst_ns * p)

    @property
    def per_second(self) -> float:
        """The rate in tokens per second."""
        return self.scale * NS_PER_SECOND / self.interval

    def rescaled(self, time: int, new: ScaledRate) -> int:
        """``time`` (in these scaled units) in ``new``'s units, rounded up:
        a due time re-expressed never comes earlier than before."""
        return -(-time // self.scale) * new.scale
