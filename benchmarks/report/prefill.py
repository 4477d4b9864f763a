"""A fair share of each step's tokens (``prefill``'s results): the light
user's time to first token beside a prefill hog, stock vLLM against ours,
and the step's cost with 1,000 users prefilling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.format import Row, fmt

TITLE = "A fair share of each step's tokens"
ABOUT = (
    "`--max-num-seqs 64 --max-num-batched-tokens 512`, ours with limits far "
    "above demand (only the step's token shares act), and ours again with the "
    "hog's prompt tokens paced at 3,000 tok/s (`--user-prompt-tokens-per-second`). "
    "The light user sends "
    "{light} short streamed requests (8 tokens out) one after another, alone "
    "and then beside `hog`, which keeps {hog} requests of ~1,400-token prompts "
    "of random words going (one token out each); the servers one after the "
    "other with the same load, figures at the client (official OpenAI client)."
)
TTFT_TARGET = 2.0  # beside / alone
LATENCY_TARGET = 2.0  # beside / alone, with the hog's prompts paced
COST_TARGET = 1.05  # ours / stock
PROMPT_RATE = "ours, hog's prompts at 3,000 tok/s"  # benchmarks/prefill.py


def _servers(results: dict[str, Any]) -> list[str]:
    """The servers measured, in the table's order (the prompt-rate one only
    in runs that had it)."""
    return [
        name for name in ("stock", "ours", PROMPT_RATE) if name in results["servers"]
    ]


def summary_rows(results: dict[str, Any]) -> list[Row]:
    ours, stock = results["servers"]["ours"], results["servers"]["stock"]
    cost = results["step_cost"]["subjects"]["ours"]["ratio"]
    return [
        (
            "prefill hog: light user's TTFT p50, beside / alone",
            f"<= {TTFT_TARGET:g}x (stock's shown)",
            f"{fmt(ours['ttft_p50_ratio'], 1)}x "
            f"(stock {fmt(stock['ttft_p50_ratio'], 1)}x)",
            ours["ttft_p50_ratio"] <= TTFT_TARGET,
        ),
        (
            "prefill hog: light user's latency p50 (8 tokens), beside / alone",
            "reported (steps stay full)",
            f"{fmt(ours['latency_p50_ratio'], 1)}x "
            f"(stock {fmt(stock['latency_p50_ratio'], 1)}x)",
            None,
        ),
        *(
            [
                (
                    "prefill hog at a prompt rate: light user's latency p50, "
                    "beside / alone",
                    f"<= {LATENCY_TARGET:g}x",
                    f"{fmt(paced['latency_p50_ratio'], 1)}x",
                    paced["latency_p50_ratio"] <= LATENCY_TARGET,
                )
            ]
            if (paced := results["servers"].get(PROMPT_RATE))
            else []
        ),
        (
            "step cost, 1,000 users prefilling, ours / stock",
            f"<= {COST_TARGET:g}x",
            f"{fmt(cost, 2)}x",
            cost <= COST_TARGET,
        ),
    ]


def headlines(results: dict[str, Any]) -> dict[str, float | None]:
    return {
        "prefill_ttft_ratio": results["servers"]["ours"]["ttft_p50_ratio"],
        "prefill_step_cost": results["step_cost"]["subjects"]["ours"]["ratio"],
    }


def section(results: dict[str, Any], figures_dir: Path, md_dir: Path) -> str:
    lines = [
        ABOUT.format(light=results["light_requests"], hog=results["hog_streams"]),
        "",
        "| server | TTFT p50 alone ms | p50 beside ms | p95 alone ms | p95 beside ms "
        "| latency p50 alone ms | beside ms | hog answers/s | hog prompt tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _servers(results):
        run = results["servers"][name]
        alone, beside = run["alone"], run["beside"]
        lines.append(
            f"| {name} | {fmt(alone['ttft_p50_s'] * 1e3, 0)} "
            f"| {fmt(beside['ttft_p50_s'] * 1e3, 0)} "
            f"| {fmt(alone['ttft_p95_s'] * 1e3, 0)} "
            f"| {fmt(beside['ttft_p95_s'] * 1e3, 0)} "
            f"| {fmt(alone['latency_p50_s'] * 1e3, 0)} "
            f"| {fmt(beside['latency_p50_s'] * 1e3, 0)} "
            f"| {fmt(run['hog_answers_per_s'], 1)} "
            f"| {fmt(run.get('hog_prompt_tokens_per_s'), 0)} |"
        )
    cost = results["step_cost"]
    lines += [
        "",
        "Beside / alone, p50 (p95): time to first token "
        + ", ".join(
            f"{name} {fmt(results['servers'][name]['ttft_p50_ratio'], 1)}x "
            f"({fmt(results['servers'][name]['ttft_p95_ratio'], 1)}x)"
            for name in _servers(results)
        )
        + "; latency "
        + ", ".join(
            f"{name} {fmt(results['servers'][name]['latency_p50_ratio'], 1)}x"
            for name in _servers(results)
        )
        + ". With the shares alone the light user's later tokens come at the "
        "pace of full steps (the hog's prompts fill each one): see "
        'docs/architecture.md, "A fair share of each step\'s tokens"; a '
        "prompt rate on the hog keeps its prompts a small part of each step "
        '("Prompt-token rates").',
        "",
        f"**Step cost with {cost['users']:,} users prefilling** (vLLM's real "
        f"scheduler and KV cache manager, no model; each user keeps one request "
        f"of a {cost['prompt_tokens']:,}-token prompt going, every prompt "
        f"distinct (the prefix cache finds nothing), "
        f"{cost['step_tokens']:,} tokens a step; {cost['rounds']} rounds side by "
        f"side in shuffled order, the median of ours / stock in the same round; "
        f"ours shared the tokens in {cost['shared_steps']} of its "
        f"{cost['rounds']} timed steps):",
        "",
        "| scheduler | step ms | / stock |",
        "|---|---:|---:|",
    ]
    subjects = cost["subjects"]
    for name in sorted(subjects, key=lambda name: (name != "stock", name)):
        subject = subjects[name]
        lines.append(
            f"| {name} | {fmt(subject['step_ms'], 2)} | {fmt(subject['ratio'], 2)} |"
        )
    return "\n".join([*lines, ""])
