"""Judged demo figures made up for the demo's tests (no server): a scene
with a light user and a throttled hog, its stock and limited runs."""

from __future__ import annotations

from vllm_output_rate.demo.figures import Outcomes, RunFigures, UserFigures
from vllm_output_rate.demo.scenes import DemoUser, Scene

LIGHT = DemoUser("light", "light", streams=1, max_tokens=4, start_after_s=1.0)
HOG = DemoUser("hog", "throttled", streams=2, max_tokens=4, limit=5, refusable=True)
SCENE = Scene(
    "test", "Test scarce", ("--max-num-seqs", "2"), (LIGHT, HOG), duration_s=5
)


def figures(
    ttft: float,
    rate: float,
    hog_rate: float | None,
    limited: bool,
    *,
    hog_outcomes: Outcomes | None = None,
    hog_bound_held: bool = True,
) -> RunFigures:
    """One run: the light user's TTFT (s) and rate, the hog's engine rate;
    at the client the light user is a little slower than at the engine."""
    light = UserFigures(
        "light",
        "light",
        1000.0 if limited else None,
        Outcomes(ok=10),
        ttft_engine_s=ttft,
        ttft_client_s=ttft + 0.05,
        rate_engine=rate,
        rate_client=rate * 0.8,
        bound_held=True if limited else None,
    )
    hog = UserFigures(
        "hog",
        "throttled",
        5.0 if limited else None,
        hog_outcomes or Outcomes(ok=40),
        rate_engine=hog_rate,
        rate_client=5.1 if limited else 2000.0,
        bound_held=hog_bound_held if limited else None,
    )
    return RunFigures(limited, {"light": light, "hog": hog}, 0.2, 0.1)


STOCK = figures(0.9, 40.0, None, limited=False)
LIMITED = figures(0.02, 150.0, 5.0, limited=True)
