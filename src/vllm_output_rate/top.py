"""``vllm-output-rate top``: a live table of every user with traffic.

It reads the plugin's admin stats endpoint (``GET /v1/output_rate/stats``,
every page) once per ``--interval`` and shows, per user: the limit, the rate
the engine delivered over the last ``--window`` seconds (engine clock, so
HTTP jitter does not show), the resident requests throttled in the engine's
last step, tokens and refunds since the user's record began, and the mean
time to first token of the requests that got one in the window (engine
side: arrival in the scheduler to the step that samples it), and how many
of its requests the API server refused at admission in the window (HTTP 429
over its own caps, 503 over vLLM's; counted by the API server that answers
the stats route). When the server limits prompt tokens, each user's prompt
tokens computed per second over the window and its prompt limit follow; on
a server with teams, each user's team, the rows grouped by team. The
columns are ``top_columns.py``'s.

On a terminal it redraws in place on the alternate screen (like ``top``; fine
over SSH), fitting the table to the terminal's height; otherwise (a pipe)
it prints one table per refresh. ``--iterations N`` stops after N tables.
A server without the plugin's admin endpoint, a refused admin key or an
unreachable URL end it with a one-line error and exit code 1; once running,
a failed refresh is shown in the footer and retried.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from vllm_output_rate.top_columns import UserRow, columns

STATS_PATH = "/v1/output_rate/stats"
ADMIN_KEY_ENV = "VLLM_OUTPUT_RATE_ADMIN_KEY"
PAGE_SIZE = 10_000
SORT_KEYS = ("rate", "name", "throttled", "ttft", "tokens")
# Lines the table needs besides its rows: header line, blank, column
# titles, their rule, the total row and its rule, the footer.
CHROME_LINES = 8


class TopError(Exception):
    """Why ``top`` cannot go on, in one line."""


@dataclass(frozen=True)
class Sample:
    """One reading of every user on record, at the engine's ``time_s``."""

    time_s: float
    users: dict[str, dict[str, Any]]
    # The server's default prompt limit; None: prompts are not limited.
    default_prompt_limit: float | None = None


def fetch(client: httpx.Client, base_url: str, admin_key: str) -> Sample:
    """Every page of the stats endpoint, as one sample."""
    users: dict[str, dict[str, Any]] = {}
    params: dict[str, str | int] = {"limit": PAGE_SIZE}
    time_s = math.nan
    prompt_limit: float | None = None
    for _ in range(10_000):  # a bound; at most 10^8 users
        try:
            response = client.get(
                base_url + STATS_PATH,
                params=params,
                headers={"Authorization": f"Bearer {admin_key}"},
            )
        except httpx.HTTPError as exc:
            raise TopError(f"cannot reach {base_url}: {_reason(exc)}") from None
        page = _page(response, base_url)
        if math.isnan(time_s):
            time_s = float(page["time_s"])
            if page.get("default_prompt_limit") is not None:
                prompt_limit = float(page["default_prompt_limit"])
        users.update(page["users"])
        if page["next"] is None:
            return Sample(time_s, users, prompt_limit)
        params = {"limit": PAGE_SIZE, "after": page["next"]}
    raise TopError(f"{base_url}: the stats pages do not end")


def _reason(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


def _page(response: httpx.Response, base_url: str) -> dict[str, Any]:
    status = response.status_code
    if status == 404:
        raise TopError(
            f"{base_url} has no vllm-output-rate admin endpoint ({STATS_PATH} "
            "answered 404): start the server with VLLM_PLUGINS=output_rate,"
            f"output_rate_http and {ADMIN_KEY_ENV} set"
        )
    if status == 401:
        raise TopError(
            f"{base_url} refused the admin key (HTTP 401): give the server's "
            f"{ADMIN_KEY_ENV} with --admin-key or in {ADMIN_KEY_ENV}"
        )
    if status == 409:
        raise TopError(f"per-user output rate limiting is not enabled on {base_url}")
    if status != 200:
        raise TopError(f"{base_url}{STATS_PATH} answered HTTP {status}")
    try:
        page = response.json()
        if not isinstance(page["users"], dict):
            raise TypeError("users")
        float(page["time_s"])
        page["next"]
    except (ValueError, KeyError, TypeError):
        raise TopError(
            f"{base_url}{STATS_PATH} did not answer with vllm-output-rate stats"
        ) from None
    return dict(page)


class Window:
    """The samples of the last ``seconds``; rates and first-token times
    over them, per user."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        # Keep the newest sample at least `seconds` old as the base.
        while (
            len(self.samples) > 2
            and sample.time_s - self.samples[1].time_s >= self.seconds
        ):
            self.samples.popleft()

    def rows(self) -> list[UserRow]:
        if not self.samples:
            return []
        newest, oldest = self.samples[-1], self.samples[0]
        span = newest.time_s - oldest.time_s
        prompts = newest.default_prompt_limit is not None
        rows = []
        for user, now in newest.users.items():
            then = oldest.users.get(user, {})
            firsts = int(now["first_tokens"]) - int(then.get("first_tokens", 0))
            waited = float(now["first_token_sum_s"]) - float(
                then.get("first_token_sum_s", 0.0)
            )
            rows.append(
                UserRow(
                    user=user,
                    limit=float(now["limit"]),
                    rate=_rate(now, then, "tokens_admitted", span),
                    throttled=int(now["resident_throttled"]),
                    tokens=int(now["tokens_admitted"]),
                    refunds=int(now["refunds"]),
                    ttft_s=waited / firsts if firsts > 0 else None,
                    idle_s=float(now["idle_s"]),
                    refused=max(0, _refusals(now) - _refusals(then)),
                    prompt_rate=(
                        _rate(now, then, "prompt_tokens", span) if prompts else None
                    ),
                    prompt_limit=float(now["prompt_limit"]) if prompts else None,
                    team=now.get("team"),
                )
            )
        return rows


def _rate(
    now: dict[str, Any], then: dict[str, Any], key: str, span: float
) -> float | None:
    """Tokens per second of the count ``key`` between two readings of a user
    ``span`` seconds apart (None: no span yet)."""
    if span <= 0:
        return None
    count, earlier = int(now[key]), int(then.get(key, 0))
    # A smaller count: the record was dropped and started again.
    return (count - earlier if count >= earlier else count) / span


def _refusals(record: dict[str, Any]) -> int:
    """Admission refusals on record (servers without admission have none)."""
    return sum(int(n) for n in (record.get("rejections") or {}).values())


def sort_rows(rows: list[UserRow], key: str) -> list[UserRow]:
    """``rows`` in ``key``'s order; on a server with teams, grouped by team
    (users in no team last), in that order within each."""
    if key == "name":
        ordered = sorted(rows, key=lambda r: r.user)
    elif key == "throttled":
        ordered = sorted(rows, key=lambda r: (-r.throttled, r.user))
    elif key == "ttft":
        ordered = sorted(rows, key=lambda r: (-(r.ttft_s or -1.0), r.user))
    elif key == "tokens":
        ordered = sorted(rows, key=lambda r: (-r.tokens, r.user))
    else:
        ordered = sorted(rows, key=lambda r: (-(r.rate or 0.0), r.idle_s, r.user))
    if any(r.team for r in rows):
        ordered.sort(key=lambda r: (r.team is None, r.team or ""))  # stable
    return ordered


def render(
    rows: list[UserRow],
    *,
    title: str,
    max_rows: int | None = None,
    footer: str = "",
    width: int = 120,
) -> Group:
    """The table, cut to ``max_rows`` users (the rest counted in the footer),
    its columns as wide as ``width`` allows (``top_columns.columns``)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_footer=True)
    shown = rows if max_rows is None else rows[: max(0, max_rows)]
    prompts = any(r.prompt_limit is not None for r in rows)
    shown_columns = columns(rows, width=width, prompts=prompts)
    for name, total, justify, _ in shown_columns:
        table.add_column(name, footer=total, justify=justify, no_wrap=True)
    for row in shown:
        table.add_row(
            *(cell(row) for *_, cell in shown_columns),
            style="bold" if row.throttled else None,
        )
    hidden = len(rows) - len(shown)
    notes = [f"{len(rows)} users"]
    if hidden:
        notes.append(f"{hidden} more not shown (a taller terminal shows them)")
    if footer:
        notes.append(footer)
    return Group(Text(title), table, Text("  ".join(notes), style="dim"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_output_rate.cli.common import positive_float, positive_int

    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root (default: %(default)s)",
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        help=f"the server's admin key (default: ${ADMIN_KEY_ENV})",
    )
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        help="seconds between refreshes",
    )
    parser.add_argument(
        "--window",
        type=positive_float,
        default=5.0,
        help="seconds over which rates and TTFT are measured (default: %(default)s)",
    )
    parser.add_argument("--sort", choices=SORT_KEYS, default="rate")
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=None,
        help="stop after this many tables (default: run until Ctrl-C)",
    )


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """The ``top`` subcommand; returns the exit code."""
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not admin_key:
        raise TopError(f"no admin key: give --admin-key or set {ADMIN_KEY_ENV}")
    base_url = args.base_url.rstrip("/")
    console = console or Console()
    window = Window(args.window)
    with httpx.Client(timeout=10.0) as client:
        window.add(fetch(client, base_url, admin_key))  # fails fast: exit 1
        screen = console.is_terminal and args.iterations is None
        # On screen the first table comes at once (its rates follow).
        tables = _tables(client, base_url, admin_key, window, args, console, screen)
        if not screen:
            for table in tables:
                console.print(table)
            return 0
        with Live(console=console, screen=True, auto_refresh=False) as live:
            for table in tables:
                live.update(table, refresh=True)
    return 0


def _tables(
    client: httpx.Client,
    base_url: str,
    admin_key: str,
    window: Window,
    args: argparse.Namespace,
    console: Console,
    first_at_once: bool,
) -> Iterator[Group]:
    """One rendered table per refresh, from the samples in ``window``."""
    count = 0
    error = ""
    while args.iterations is None or count < args.iterations:
        if count or not first_at_once:
            time.sleep(args.interval)
            try:
                window.add(fetch(client, base_url, admin_key))
                error = ""
            except TopError as exc:
                error = f"last refresh failed: {exc}"
        count += 1
        rows = sort_rows(window.rows(), args.sort)
        title = (
            f"vllm-output-rate top  {base_url}  {time.strftime('%H:%M:%S')}  "
            f"rates over {args.window:g} s, refreshed every {args.interval:g} s"
        )
        height = console.size.height if console.is_terminal else None
        yield render(
            rows,
            title=title,
            max_rows=None if height is None else height - CHROME_LINES,
            footer=error or "Ctrl-C quits",
            width=console.size.width,
        )
