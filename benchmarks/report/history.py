"""The history table: one row per run (``results.history.json``), its date,
commit, sections and headline ratios (each section module's
``headlines``), newest last. Rows converted from the hand-kept history that
came before may hold a text (a range, or figures by R) instead of a number,
and a note."""

from __future__ import annotations

from typing import Any

COLUMNS = {
    "plain_engine": "engine, limits not binding",
    "prompt_engine": "engine, long prompts, prompt rates not binding",
    "hybrid_engine": "hybrid model's engine",
    "step": "scheduler step, nobody throttled (worst)",
    "isolation": "B beside A / alone",
    "accuracy": "engine rate / limit (farthest from 1)",
    "store_engine": "engine with the store / without",
    "speculative_engine": "speculative engine",
    "speculative_step": "speculative `schedule()` from R = 64 (worst)",
    "saturated_engine": "saturated engine (fair shares)",
    "contested_step": "step with every slot contested (worst U)",
    "kv_full_sampled": "tokens sampled with the KV cache full (worst U)",
    "admission_server": "server with admission caps not binding",
    "cache_salt_latency": "later user's latency with the cache salt / without",
    "prefill_ttft_ratio": "light TTFT beside a prefill hog / alone",
    "prefill_step_cost": "step with 1,000 users prefilling",
    "teams_step_cost": "step with 100 teams x 100 users / users only",
    "teams_accuracy": "a team's engine rate / its limit",
}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The history as Markdown: ratios are ours / stock (or with / without
    the store), each from the run named in its row."""
    if not rows:
        return ["No run recorded yet."]
    head = ["date", "commit", "sections", *COLUMNS.values(), "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.get("date"), row.get("commit"), ", ".join(row.get("sections", []))]
        cells += [row.get(key) for key in COLUMNS]
        cells.append(row.get("note"))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines
