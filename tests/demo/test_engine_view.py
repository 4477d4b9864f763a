"""The demo's engine view: rates and the bound from stats readings."""

from __future__ import annotations

from vllm_output_rate.demo.engine_view import EngineWatch, Reading


def watch(*readings: tuple[float, int]) -> EngineWatch:
    engine = EngineWatch("http://unused", "key")
    engine.readings = [Reading(t, {"a": n}) for t, n in readings]
    return engine


def test_rates_and_series_come_from_the_engine_counts() -> None:
    engine = watch((10.0, 0), (10.5, 10), (11.0, 20), (12.0, 20))
    assert engine.series("a", start_s=10.0) == (
        [0.0, 0.5, 1.0],
        [20.0, 20.0, 0.0],
    )
    # Between the first and last readings in the window: 20 tokens in 1 s.
    assert engine.rate("a", 10.0, 11.0) == 20.0
    assert engine.rate("a", 10.0, 12.0) == 10.0  # an idle second counts
    assert engine.rate("a", 10.6, 11.5) is None  # one reading inside
    assert engine.rate("nobody", 10.0, 12.0) == 0.0


def test_the_bound_is_checked_on_every_pair_of_readings() -> None:
    # 10 tok/s: 0.5 s may hold (0.5 + 0.1) * 10 + 1 = 7 tokens, not 8.
    assert watch((0.0, 0), (0.5, 7), (1.0, 12)).bound_held("a", 10)
    assert not watch((0.0, 0), (0.5, 8)).bound_held("a", 10)
    # Each step within the bound, the whole run not: caught too.
    assert not watch((0, 0), (1, 11), (2, 22), (3, 33)).bound_held("a", 10)
    # Only while the limit was in force: the demo lifts it after the window.
    lifted = watch((0.0, 0), (0.5, 7), (1.0, 12), (1.5, 500))
    assert lifted.bound_held("a", 10, until_s=1.0)
    assert not lifted.bound_held("a", 10)
