"""Read a gauge or counter from a vLLM server's Prometheus text (/metrics).

vLLM labels its series (``model_name``, ``engine``); a test or benchmark
wants the total over them, so these sum every series of one name.
"""

from __future__ import annotations

import httpx


def metric_total(metrics_text: str, name: str) -> float:
    """The sum of every series of ``name`` in Prometheus text; 0 if none."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def scrape_total(url: str, name: str) -> float:
    """``metric_total`` of the server at ``url``'s /metrics."""
    return metric_total(httpx.get(url + "/metrics", timeout=30).text, name)
