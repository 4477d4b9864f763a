"""``vllm-output-rate top`` without vLLM: rates over the window, the table
on a fake terminal of a set size, and every answer a server can give, from
a real local HTTP server (tests/e2e/test_operator_tools.py runs it against
vLLM)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from rich.console import Console

from vllm_output_rate import cli
from vllm_output_rate.top import (
    Sample,
    TopError,
    UserRow,
    Window,
    fetch,
    render,
    sort_rows,
)


def user(tokens: int, *, firsts: int = 0, waited: float = 0.0, **extra) -> dict:
    return {
        "tokens_admitted": tokens,
        "limit": 20.0,
        "resident_throttled": 0,
        "refunds": 0,
        "first_tokens": firsts,
        "first_token_sum_s": waited,
        "idle_s": 0.0,
        **extra,
    }


def test_rates_and_first_token_times_over_the_window() -> None:
    window = Window(seconds=2.0)
    window.add(Sample(10.0, {"a": user(100, firsts=1, waited=0.5)}))
    assert window.rows()[0].rate is None  # one reading: no rate yet
    window.add(Sample(11.0, {"a": user(120, firsts=3, waited=0.9), "b": user(5)}))
    rows = {r.user: r for r in window.rows()}
    assert rows["a"].rate == 20.0
    assert rows["a"].ttft_s == pytest.approx(0.2)  # (0.9 - 0.5) / 2 new
    assert rows["b"].rate == 5.0 and rows["b"].ttft_s is None
    window.add(Sample(12.0, {"a": user(150, firsts=3, waited=0.9)}))
    window.add(Sample(13.0, {"a": user(160, firsts=3, waited=0.9)}))
    # Only readings within 2 s of the newest are kept as the base.
    assert [s.time_s for s in window.samples] == [11.0, 12.0, 13.0]
    assert window.rows()[0].rate == 20.0  # (160 - 120) / 2
    # A record that started again (fewer tokens than before) is no negative rate.
    window.add(Sample(14.0, {"a": user(4)}))
    assert window.rows()[0].rate == pytest.approx(4 / 2)


def test_admission_refusals_over_the_window() -> None:
    window = Window(seconds=5.0)
    window.add(Sample(1.0, {"a": user(10, rejections={"x": 2}), "b": user(5)}))
    window.add(Sample(2.0, {"a": user(20, rejections={"x": 5, "y": 1}), "b": user(6)}))
    found = {r.user: r.refused for r in window.rows()}
    assert found == {"a": 4, "b": 0}
    console = Console(width=120, height=10, force_terminal=True, record=True)
    console.print(render(window.rows(), title="top"))
    text = console.export_text()
    assert "refused" in text and max(map(len, text.splitlines())) <= 120


def test_prompt_rates_and_limits_when_the_server_limits_prompts() -> None:
    window = Window(seconds=5.0)
    prompt = {"prompt_limit": 1_000.0}
    window.add(Sample(1.0, {"a": user(10, prompt_tokens=400, **prompt)}, 2_000.0))
    window.add(
        Sample(
            3.0,
            {
                "a": user(20, prompt_tokens=1_400, **prompt),
                "b": user(5, prompt_tokens=300, prompt_limit=2_000.0),
            },
            2_000.0,
        )
    )
    found = {r.user: (r.prompt_rate, r.prompt_limit) for r in window.rows()}
    assert found == {"a": (500.0, 1_000.0), "b": (150.0, 2_000.0)}
    for width, totals in ((120, True), (100, False)):
        console = Console(width=width, height=10, force_terminal=True, record=True)
        console.print(render(window.rows(), title="top", width=width))
        text = console.export_text()
        assert "prompt/s" in text and "p. limit" in text
        assert "650" in text and "2,000" in text  # the total; b's limit
        # The counts since the records began give way on a narrower terminal.
        assert ("tokens" in text) is totals
        assert max(map(len, text.splitlines())) <= width
    # A server without prompt limits: no prompt columns, as before.
    plain = Window(seconds=5.0)
    plain.add(Sample(1.0, {"a": user(10)}))
    plain.add(Sample(2.0, {"a": user(20)}))
    assert plain.rows()[0].prompt_rate is None
    console = Console(width=120, height=10, force_terminal=True, record=True)
    console.print(render(plain.rows(), title="top"))
    text = console.export_text()
    assert "prompt" not in text and "tokens" in text


def test_users_are_grouped_by_team_on_a_server_with_teams() -> None:
    window = Window(seconds=5.0)
    readings = {
        "zed": user(0, team="alpha"),
        "amy": user(0),
        "bob": user(0, team="beta"),
        "cat": user(0, team="alpha"),
    }
    window.add(Sample(1.0, readings))
    window.add(
        Sample(
            2.0,
            {
                "zed": user(30, team="alpha"),
                "amy": user(90),
                "bob": user(10, team="beta"),
                "cat": user(20, team="alpha"),
            },
        )
    )
    ordered = sort_rows(window.rows(), "rate")
    # By team (no team last), by rate within each.
    assert [(r.team, r.user) for r in ordered] == [
        ("alpha", "zed"),
        ("alpha", "cat"),
        ("beta", "bob"),
        (None, "amy"),
    ]
    console = Console(width=120, height=12, force_terminal=True, record=True)
    console.print(render(ordered, title="top"))
    text = console.export_text()
    assert "team" in text and "alpha" in text
    # Without teams: no team column, the plain order.
    assert "team" not in _table_text(rows(3))


def _table_text(table_rows: list[UserRow]) -> str:
    console = Console(width=120, height=12, force_terminal=True, record=True)
    console.print(render(table_rows, title="top"))
    return console.export_text()


def rows(count: int) -> list[UserRow]:
    return [
        UserRow(f"user-{i:02d}", 20.0, 19.5, i % 2, 1000 + i, 0, 0.25, 0.0)
        for i in range(count)
    ]


def test_the_table_fits_a_small_terminal_and_says_what_it_left_out() -> None:
    console = Console(width=90, height=14, force_terminal=True, record=True)
    console.print(render(rows(12), title="vllm-output-rate top", max_rows=6))
    text = console.export_text()
    assert "user-05" in text and "user-06" not in text
    assert "6 more not shown" in text
    assert "12 users" in text
    assert "234.0" in text  # the total rate of all 12
    assert "250" in text  # TTFT in ms
    assert max(map(len, text.splitlines())) <= 90


def test_a_narrow_terminal_still_renders() -> None:
    console = Console(width=50, height=10, force_terminal=True, record=True)
    console.print(render(rows(3), title="top", max_rows=2, width=50))
    text = console.export_text()
    assert "user-00" in text and "TTFT ms" in text  # the main columns
    assert "idle s" not in text
    assert max(map(len, text.splitlines())) <= 50


class Canned(BaseHTTPRequestHandler):
    """Answers /v1/output_rate/stats as the `mode` query of the URL says."""

    pages: ClassVar[dict[str | None, dict]] = {
        None: {"time_s": 1.0, "users": {"a": user(1)}, "next": "a", "total": 2},
        "a": {"time_s": 1.0, "users": {"b": user(2)}, "next": None, "total": 2},
    }

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode in ("paged", "prompts") and url.path == "/v1/output_rate/stats":
            page = dict(self.pages[query.get("after", [None])[0]])
            if mode == "prompts":  # the server limits prompt tokens
                page["default_prompt_limit"] = 500
            self._send(200, json.dumps(page).encode())
        elif mode == "html":
            self._send(200, b"<html>hello</html>", "text/html")
        else:
            self._send(int(mode), b'{"error": {}}')

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def canned() -> Iterator[tuple[str, ThreadingHTTPServer]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


def test_every_page_is_read(canned) -> None:
    url, server = canned
    server.mode = "paged"
    with httpx.Client() as client:
        sample = fetch(client, url, "key")
        assert set(sample.users) == {"a", "b"}
        assert sample.default_prompt_limit is None
        server.mode = "prompts"
        assert fetch(client, url, "key").default_prompt_limit == 500.0


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("404", "has no vllm-output-rate admin endpoint"),
        ("401", "refused the admin key"),
        ("409", "limiting is not enabled"),
        ("500", "answered HTTP 500"),
        ("html", "did not answer with vllm-output-rate stats"),
    ],
)
def test_each_bad_answer_is_one_clear_line(
    canned, mode: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url, server = canned
    server.mode = mode
    with httpx.Client() as client, pytest.raises(TopError, match=message):
        fetch(client, url, "key")
    # From the command line: the same line on stderr, exit code 1.
    assert cli.main(["top", "--base-url", url, "--admin-key", "k"]) == 1
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [["--interval", "0"], ["--window", "x"], ["--sort", "size"], ["--iterations", "0"]],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["top", *argv])
    assert stopped.value.code == 2
