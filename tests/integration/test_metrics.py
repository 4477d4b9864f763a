"""The Prometheus families rendered from an engine snapshot, without vLLM:
the prompt-token counter per user label, and the prompt-limit gauge only
when the snapshot has prompt limits (prompt-token limits on)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_output_rate.integration.metrics import PREFIX, OutputRateCollector
from vllm_output_rate.scheduling.metric_labels import OTHER_USERS
from vllm_output_rate.scheduling.stats import OutputRateStats


def scrape(
    snapshot: dict[str, Any], label: str = "user"
) -> dict[tuple[str, str | None], float]:
    collector = OutputRateCollector()
    collector.update(snapshot)
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.name, s.labels.get(label)): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def labels_snapshot() -> dict[str, Any]:
    stats = OutputRateStats(["alice"], recent_users=0)
    stats.record_step(1, Counter({"alice": 2}), Counter(), Counter())
    stats.record_prompt_tokens(1, Counter({"alice": 300, "x": 40}))
    return stats.snapshot()


def test_prompt_tokens_and_prompt_limits_per_label() -> None:
    labels = labels_snapshot()
    samples = scrape(
        {
            "labels": labels,
            "limits": {"__default__": 20.0, "alice": 50.0},
            "prompt_limits": {"__default__": 1_000.0, "alice": 4_000.0},
        }
    )
    counter = PREFIX + "prompt_tokens_total"
    assert samples[(counter, "alice")] == 300
    assert samples[(counter, OTHER_USERS)] == 40
    gauge = PREFIX + "prompt_limit_tokens_per_second"
    assert samples[(gauge, "alice")] == 4_000.0
    assert samples[(gauge, "__default__")] == 1_000.0
    # The output limit gauge is the output limit's, as before.
    assert samples[(PREFIX + "limit_tokens_per_second", "alice")] == 50.0


def test_without_prompt_limits_there_is_no_prompt_limit_gauge() -> None:
    stats = OutputRateStats(["alice"], recent_users=0)
    stats.record_step(1, Counter({"alice": 2}), Counter(), Counter())
    samples = scrape({"labels": stats.snapshot(), "limits": {"__default__": 20.0}})
    assert samples[(PREFIX + "tokens_admitted_total", "alice")] == 2
    # The counter is there (a dashboard's rate() answers 0), the gauge not.
    assert samples[(PREFIX + "prompt_tokens_total", "alice")] == 0
    assert not any("prompt_limit" in name for name, _ in samples)


def test_each_team_has_its_tokens_and_limit() -> None:
    teams = {
        "crew": {"limit": 40.0, "members": 2, "tokens": 123},
        "quiet": {"limit": 5.0, "members": 1, "tokens": 0},
    }
    snapshot = {"labels": labels_snapshot(), "limits": {}, "teams": teams}
    samples = scrape(snapshot, label="team")
    assert samples[(PREFIX + "team_tokens_total", "crew")] == 123
    assert samples[(PREFIX + "team_tokens_total", "quiet")] == 0
    assert samples[(PREFIX + "team_limit_tokens_per_second", "crew")] == 40.0


def test_without_teams_there_is_no_team_family() -> None:
    samples = scrape({"labels": labels_snapshot(), "limits": {"__default__": 10.0}})
    assert not any("team" in name for name, _ in samples)
