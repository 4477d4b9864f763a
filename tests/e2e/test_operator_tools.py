"""The operator's tools on a live server under load: ``vllm-output-rate top``
in a real terminal (a pseudo-terminal of a set size, read back through a
terminal emulator), and the shipped Grafana dashboard, every query of which
a real Prometheus evaluates against the server's metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyte
import pytest

from harness.prometheus_server import Prometheus, running_prometheus
from vllm_output_rate import cli
from vllm_output_rate.demo.server import free_port, running_server
from vllm_output_rate.loadtest import LoadSpec, UserLoad, run_load_sync

pytestmark = pytest.mark.e2e

ADMIN_KEY = "operator-admin-key"
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "vllm-output-rate.json"
LIMITS = {"user-a": 20.0, "user-b": 50.0}
DEFAULT_LIMIT = 30.0
LOAD_S = 25.0


@pytest.fixture(scope="module")
def server(tiny_model_path: str) -> Iterator[str]:
    args = [
        "--default-user-output-tokens-per-second",
        str(DEFAULT_LIMIT),
        "--user-output-tokens-per-second",
        json.dumps(LIMITS),
        # user-a's third stream is refused (429) and retried: the
        # dashboard's admission panel has something to show.
        "--default-user-max-concurrent-requests",
        "2",
        # A team far above its member's limit: the team panel has data.
        "--output-rate-teams",
        json.dumps(
            {"b-team": {"output_tokens_per_second": 1000, "members": ["user-b"]}}
        ),
    ]
    env = {
        "VLLM_PLUGINS": "output_rate,output_rate_http",
        "VLLM_OUTPUT_RATE_ADMIN_KEY": ADMIN_KEY,
    }
    with running_server(tiny_model_path, args, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def prometheus(server: str) -> Iterator[Prometheus]:
    with running_prometheus([server.removeprefix("http://")]) as instance:
        yield instance


@pytest.fixture(scope="module")
def load(server: str, tiny_model_path: str, prometheus: Prometheus) -> Iterator[None]:
    """Steady traffic for the whole module: two limited users and anonymous
    requests, each wanting more than its limit."""
    spec = LoadSpec(
        base_url=server,
        model=tiny_model_path,
        users=[UserLoad("user-a", 3), UserLoad("user-b", 2), UserLoad(None, 1)],
        max_tokens=30,
        duration_s=LOAD_S,
    )
    results = []
    thread = threading.Thread(target=lambda: results.append(run_load_sync(spec)))
    thread.start()
    time.sleep(3)  # every user has traffic
    yield
    thread.join()
    assert results and results[0].ok, results and results[0].error_summary()


def read_screen(process: subprocess.Popen, fd: int, screen: pyte.Screen, s: float):
    stream = pyte.ByteStream(screen)
    deadline = time.monotonic() + s
    os.set_blocking(fd, False)
    while time.monotonic() < deadline and process.poll() is None:
        try:
            stream.feed(os.read(fd, 65536))
        except (BlockingIOError, OSError):
            time.sleep(0.05)


def test_top_shows_every_user_live_in_a_terminal(server: str, load: None) -> None:
    import fcntl
    import termios

    columns, lines = 120, 30
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    env = {
        k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")
    }
    env.update(TERM="xterm-256color", VLLM_OUTPUT_RATE_ADMIN_KEY=ADMIN_KEY)
    # As a person at a terminal runs it, Ctrl-C included: a child inherits an
    # ignored SIGINT (a CI job started in the background has one), and Python
    # then installs no KeyboardInterrupt handler; both fresh-clone runs of
    # 2026-12-02 that hung on the signal below were started that way.
    command = [
        sys.executable,
        "-c",
        "import runpy, signal;"
        " signal.signal(signal.SIGINT, signal.default_int_handler);"
        " runpy.run_module('vllm_output_rate.cli', run_name='__main__')",
        "top",
    ]
    command += ["--base-url", server, "--interval", "0.5", "--window", "3"]
    process = subprocess.Popen(
        command,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    screen = pyte.Screen(columns, lines)
    try:
        read_screen(process, master, screen, 6.0)
        text = "\n".join(screen.display)
        assert process.poll() is None, text  # still running, redrawing
        assert "vllm-output-rate top" in text
        # user-b's row names its team (the column after the user's).
        assert "b-team" in text, text
        rows = {
            line.split()[0]: [cell for cell in line.split() if cell != "b-team"]
            for line in screen.display
            if line.split() and line.split()[0] in ("user-a", "user-b", "__anonymous__")
        }
        assert set(rows) == {"user-a", "user-b", "__anonymous__"}, text
        # user, limit, tok/s, % of limit, ...: the engine's rate for each
        # user near its limit (demand is above it), measured over 3 s.
        for user, limit in (*LIMITS.items(), ("__anonymous__", DEFAULT_LIMIT)):
            assert float(rows[user][1].replace(",", "")) == limit
            rate = float(rows[user][2].replace(",", ""))
            assert 0.6 * limit <= rate <= 1.2 * limit, (user, text)
        process.send_signal(signal.SIGINT)  # how a person quits it
        # Keep reading while it quits (it leaves the alternate screen on the
        # way out; a write to a pty nobody reads can block), but not long:
        # the module's load ends LOAD_S after this test starts.
        read_screen(process, master, screen, 10.0)
        assert process.wait(timeout=2) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)


def top(*argv: str) -> int:
    return cli.main(["top", *argv])


def test_top_in_a_pipe_prints_tables_and_bad_targets_get_one_line(
    server: str, load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        top(
            "--base-url",
            server,
            "--admin-key",
            ADMIN_KEY,
            "--iterations",
            "2",
            "--interval",
            "0.5",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("vllm-output-rate top") == 2
    assert "user-a" in out and "user-b" in out
    for argv, message in (
        (["--admin-key", "wrong"], "refused the admin key"),
        ([], "no admin key"),
    ):
        assert top("--base-url", server, "--iterations", "1", *argv) == 1
        error = capsys.readouterr().err.strip()
        assert message in error and len(error.splitlines()) == 1, error
    nobody = f"http://127.0.0.1:{free_port()}"
    assert top("--base-url", nobody, "--admin-key", "k", "--iterations", "1") == 1
    error = capsys.readouterr().err.strip()
    assert "cannot reach" in error and len(error.splitlines()) == 1, error


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def concrete(expr: str) -> str:
    """The query as Grafana sends it with every user selected."""
    expr = expr.replace("$__rate_interval", "20s").replace('=~"$user"', '=~".*"')
    assert "$" not in expr, expr  # no other variable to fill in
    return expr


def test_every_dashboard_query_answers_from_a_real_prometheus(
    prometheus: Prometheus, load: None
) -> None:
    prometheus.wait_for_scrapes(15)
    dashboard = json.loads(DASHBOARD.read_text())
    (users_variable,) = [
        v for v in dashboard["templating"]["list"] if v["name"] == "user"
    ]
    metric = re.fullmatch(r"label_values\((.+), user\)", users_variable["definition"])
    assert metric, users_variable["definition"]
    users = prometheus.label_values("user", metric.group(1))
    assert {"user-a", "user-b", "__anonymous__"} <= set(users)
    for title, expr in dashboard_queries():
        result = prometheus.query(concrete(expr))
        values = [float(series["value"][1]) for series in result]
        assert any(v == v for v in values), (title, expr, result)  # a non-NaN value
    # The main panel says what the engine did: each user near its limit.
    delivered = {
        series["metric"]["user"]: float(series["value"][1])
        for series in prometheus.query(concrete(dashboard_queries()[0][1]))
    }
    for user, limit in (*LIMITS.items(), ("__anonymous__", DEFAULT_LIMIT)):
        assert 0.6 * limit <= delivered[user] <= 1.2 * limit, (user, delivered)
    # The admission panel: user-a's third stream, refused over its own cap.
    (refusals,) = [e for t, e in dashboard_queries() if "admission_rejections" in e][:1]
    refused = {
        (series["metric"]["user"], series["metric"]["reason"])
        for series in prometheus.query(concrete(refusals))
    }
    assert ("user-a", "user_max_concurrent_requests") in refused, refused
