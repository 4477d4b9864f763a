"""The specification's window bound, checked exactly over token times."""

from __future__ import annotations

from fractions import Fraction

MS = 1_000_000
S = 1_000_000_000
BURST_NS = 100 * MS


def assert_window_bound(
    admitted_at: list[int], rate: float, *, engines: int = 1
) -> None:
    """Every window that starts and ends at an admitted token holds at most
    ``(W + burst) x rate + engines`` tokens (one engine: the specification's
    ``+ 1``; N engines sharing a store: ``+ N``, see docs/architecture.md,
    "The shared store").

    Those windows are the tightest: any other window holds no more tokens than
    the one shrunk to its first and last admitted token. With
    f(k) = k - rate * t_k, the window from token i to token j holds
    j - i + 1 tokens and the bound reads
    f(j) - f(i) <= burst * rate + engines - 1, so one pass with a running
    minimum checks all of them, in exact integers. ``admitted_at`` is sorted.
    """
    fraction = Fraction(repr(rate))
    p, q = fraction.numerator, fraction.denominator
    # burst * rate + engines - 1, scaled by q * 1e9
    allowed = p * BURST_NS + (engines - 1) * q * S
    lowest = None
    for k, t in enumerate(admitted_at):
        f = k * q * S - p * t
        if lowest is not None:
            assert f - lowest <= allowed, (
                f"bound broken at token {k} of {len(admitted_at)} ({rate} tok/s)"
            )
        lowest = f if lowest is None else min(lowest, f)


def assert_bound(times_ns: list[int], rate: float) -> None:
    """One engine's bound, (W + 0.1) x rate + 1, over unsorted times."""
    assert_window_bound(sorted(times_ns), rate)
