"""The specification's rate bound, checked exactly over dispatch times."""

from __future__ import annotations

from fractions import Fraction

MS = 1_000_000
S = 1_000_000_000


def assert_bound(times_ns: list[int], rate: float) -> None:
    """At most (W + 0.1) * rate + 1 tokens in every window of W seconds.

    With f(k) = k - rate * t_k over the sorted token times, the bound for the
    window from token i to token j is f(j) - f(i) <= 0.1 * rate, so one pass
    with a running minimum checks every window exactly (integer arithmetic).
    """
    rate_fraction = Fraction(repr(rate))
    p, q = rate_fraction.numerator, rate_fraction.denominator
    allowed = p * 100 * MS  # 0.1 s * rate, scaled by q * 1e9
    lowest = None
    for k, t in enumerate(sorted(times_ns)):
        f = k * q * S - p * t
        if lowest is not None:
            assert f - lowest <= allowed, f"bound broken at token {k} ({rate} tok/s)"
        lowest = f if lowest is None else min(lowest, f)
