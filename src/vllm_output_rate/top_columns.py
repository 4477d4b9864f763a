"""The columns of ``vllm-output-rate top``'s table (``top.py``), no I/O.

``UserRow`` is one user's line: what ``top.Window`` measured over its
window. ``columns(rows, width, prompts)`` gives each column's title, its
footer (a total where one means something), its justification and the
function that writes a row's cell: the main columns always, the others
from ``WIDE`` columns of terminal ``width`` on, and the prompt-token columns
(prompt tokens computed per second and the prompt limit) only when the
server limits prompt tokens (``prompts``), so a table without them is as
before. With them, the cumulative tokens and refunds give the prompt
columns their place on a terminal narrower than ``WIDEST``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.console import JustifyMethod


@dataclass(frozen=True)
class UserRow:
    user: str
    limit: float
    rate: float | None  # tok/s over the window; None before two readings
    throttled: int
    tokens: int
    refunds: int
    ttft_s: float | None  # mean over the window's first tokens
    idle_s: float
    refused: int = 0  # requests refused at admission in the window
    # Prompt tokens computed per second over the window (None before two
    # readings) and the prompt limit: None when prompts are not limited.
    prompt_rate: float | None = None
    prompt_limit: float | None = None
    team: str | None = None  # its team, on a server with teams


# (title, footer, justify, the cell of a row)
Column = tuple[str, str, JustifyMethod, Callable[[UserRow], str]]
# Terminal widths from which the columns besides the main ones are shown,
# and from which every column fits beside the prompt columns (rich cuts
# cells, user names included, when the table is wider than the terminal).
WIDE = 80
WIDEST = 112


def number(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _share(row: UserRow) -> str:
    return number(None if row.rate is None else 100 * row.rate / row.limit, 0)


def _ttft_ms(row: UserRow) -> str:
    return number(None if row.ttft_s is None else 1000 * row.ttft_s, 0)


def columns(rows: list[UserRow], *, width: int, prompts: bool) -> list[Column]:
    """The table's columns for ``rows`` (their totals in the footers) on a
    terminal ``width`` columns wide."""
    total_rate = sum(r.rate or 0.0 for r in rows)
    # The counts since each record began: the first to give way.
    totals = WIDEST if prompts else WIDE
    # (column, the least terminal width that shows it)
    listed: list[tuple[Column, int]] = [
        (("user", "all", "left", lambda r: r.user), 0),
    ]
    if any(r.team for r in rows):
        listed.append((("team", "", "left", lambda r: r.team or ""), 0))
    listed += [
        (("limit", "", "right", lambda r: number(r.limit)), 0),
        (("tok/s", number(total_rate), "right", lambda r: number(r.rate)), 0),
        (("%", "", "right", _share), WIDE),
        (
            (
                "throttled",
                str(sum(r.throttled for r in rows)),
                "right",
                lambda r: str(r.throttled) if r.throttled else "",
            ),
            0,
        ),
        (
            (
                "tokens",
                f"{sum(r.tokens for r in rows):,}",
                "right",
                lambda r: f"{r.tokens:,}",
            ),
            totals,
        ),
        (
            (
                "refunds",
                f"{sum(r.refunds for r in rows):,}",
                "right",
                lambda r: f"{r.refunds:,}" if r.refunds else "",
            ),
            totals,
        ),
        (("TTFT ms", "", "right", _ttft_ms), 0),
    ]
    if prompts:
        total_prompt = sum(r.prompt_rate or 0.0 for r in rows)
        listed += [
            (
                (
                    "prompt/s",
                    number(total_prompt, 0),
                    "right",
                    lambda r: number(r.prompt_rate, 0),
                ),
                WIDE,
            ),
            (("p. limit", "", "right", lambda r: number(r.prompt_limit, 0)), WIDE),
        ]
    listed += [
        (
            (
                "refused",
                str(sum(r.refused for r in rows)),
                "right",
                lambda r: f"{r.refused:,}" if r.refused else "",
            ),
            WIDE,
        ),
        (("idle s", "", "right", lambda r: number(r.idle_s, 0)), WIDE),
    ]
    return [column for column, least in listed if width >= least]
