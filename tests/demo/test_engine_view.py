"""The demo's engine view: rates and the bound from stats readings, TTFT
quantiles from the real metrics text our collector renders."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm_output_rate.demo.engine_view import (
    EngineWatch,
    Reading,
    first_token_quantiles,
)
from vllm_output_rate.integration.metrics import OutputRateCollector
from vllm_output_rate.scheduling.stat_records import NS_PER_S
from vllm_output_rate.scheduling.stats import OutputRateStats


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


def test_first_token_quantiles_from_the_metrics_we_render() -> None:
    stats = OutputRateStats(["alice"], recent_users=0)
    s = NS_PER_S
    # 10 first tokens after 0.02 s, 5 after 0.2 s, 6 after 2 s.
    waits = [s // 50] * 10 + [s // 5] * 5 + [2 * s] * 6
    stats.record_first_tokens(3 * s, [("alice", 3 * s - w) for w in waits])
    stats.record_step(3 * s, Counter({"alice": 1}), Counter(), Counter())
    collector = OutputRateCollector()
    collector.update({"labels": stats.snapshot(), "limits": {"__default__": 5.0}})
    registry = CollectorRegistry()
    registry.register(collector)
    quantiles = first_token_quantiles(generate_latest(registry).decode())
    p50, p95 = quantiles["alice"]
    # Bucket interpolation as Prometheus does: the median in (0.1, 0.25],
    # p95 in (1, 2.5].
    assert 0.1 < p50 <= 0.25
    assert 1.0 < p95 <= 2.5
    assert set(quantiles) == {"alice"}  # only labels with a histogram


def test_no_first_token_gives_no_quantile() -> None:
    stats = OutputRateStats(["alice"], recent_users=0)
    stats.record_step(1, Counter({"alice": 1}), Counter(), Counter())
    collector = OutputRateCollector()
    collector.update({"labels": stats.snapshot(), "limits": {}})
    registry = CollectorRegistry()
    registry.register(collector)
    assert first_token_quantiles(generate_latest(registry).decode()) == {
        "alice": [None, None]
    }


@pytest.mark.parametrize("q", [0.5, 0.95])
def test_quantiles_of_an_empty_text(q: float) -> None:
    assert first_token_quantiles("", (q,)) == {}
