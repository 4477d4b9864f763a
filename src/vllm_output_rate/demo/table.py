"""The tables the demo prints at the end: per scene, one line per user.

Each figure is shown as ``stock -> with limits``: the light user's time to
first token (p50) at the engine and at the client; every user's rate at
the engine and at the client (stock vLLM has no per-user count at the
engine but the light user's per-request timings); the requests completed,
with any refused by design, answered 503 by stock vLLM's full queue, or
failed; and the verdict in a word or two.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from vllm_output_rate.demo.figures import Outcomes, UserFigures
from vllm_output_rate.demo.judging import SceneResult

WIDTH = 120
COLUMNS = (
    ("user", "left"),
    ("limit", "right"),
    ("TTFT p50 ms\nengine", "right"),
    ("TTFT p50 ms\nclient", "right"),
    ("tok/s\nengine", "right"),
    ("tok/s\nclient", "right"),
    ("requests", "right"),
    ("verdict", "left"),
)


def _pair(before: float | None, after: float | None, scale: float = 1.0) -> str:
    def one(value: float | None) -> str:
        if value is None:
            return "-"
        value *= scale
        return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.1f}"

    return f"{one(before)} → {one(after)}"


def _requests(outcomes: Outcomes) -> str:
    text = str(outcomes.ok)
    if outcomes.refused:
        text += f" +{outcomes.refused} refused"
    if outcomes.queue_full:
        text += f" +{outcomes.queue_full} 503"
    if outcomes.failed:
        text += f" +{len(outcomes.failed)} FAILED"
    return text


def _row(result: SceneResult, name: str) -> list[str]:
    before: UserFigures = result.stock.users[name]
    after: UserFigures = result.limited.users[name]
    light = before.role == "light"
    verdict = next(v for v in result.verdicts if v.user == name)
    return [
        name,
        "-" if after.limit is None else f"{after.limit:g}",
        _pair(before.ttft_engine_s, after.ttft_engine_s, 1000) if light else "",
        _pair(before.ttft_client_s, after.ttft_client_s, 1000) if light else "",
        _pair(before.rate_engine, after.rate_engine),
        _pair(before.rate_client, after.rate_client),
        f"{_requests(before.outcomes)} → {_requests(after.outcomes)}",
        verdict.short,
    ]


def scene_table(result: SceneResult) -> str:
    flags = " ".join(result.scene.server_args)
    table = Table(
        title=f"{result.scene.title} ({flags}): stock vLLM → with limits",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for name, justify in COLUMNS:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for user in result.scene.users:
        table.add_row(*_row(result, user.name))
    buffer = io.StringIO()
    Console(file=buffer, width=WIDTH, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def format_table(results: Sequence[SceneResult]) -> str:
    """Per scene a small table, one line per user."""
    return "\n\n".join(scene_table(r) for r in results)
