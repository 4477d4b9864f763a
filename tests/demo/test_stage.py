"""The demo's stage without vLLM: servers started together and all stopped
(a fake server command, as in test_server.py), and a stock run of a scene
against the scripted OpenAI server (harness.fake_openai_server)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.fake_openai_server import ENGINE_METRICS
from vllm_output_rate.demo import server
from vllm_output_rate.demo.figures import run_figures
from vllm_output_rate.demo.scenes import DemoUser, Scene
from vllm_output_rate.demo.stage import COMMON_ARGS, Servers, ServerSpec, play

FAKE_SERVER = r"""
import http.server, sys, time
port = int(sys.argv[1])
if "fail" in sys.argv:
    time.sleep(0.5)
    print("FATAL: no KV cache", flush=True)
    sys.exit(3)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

LIGHT = DemoUser("light", "light", streams=1, max_tokens=10, start_after_s=0.3)
HOG = DemoUser("hog", "throttled", streams=3, max_tokens=10, limit=5)


def scene(key: str, *args: str) -> Scene:
    return Scene(key, key, args, (LIGHT, HOG), duration_s=1.0)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        server,
        "server_command",
        lambda model_path, port, extra_args=(): [
            sys.executable,
            "-c",
            FAKE_SERVER,
            str(port),
            *extra_args,
        ],
    )


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.usefixtures("fake_vllm")
def test_servers_start_together_and_all_stop(tmp_path: Path) -> None:
    a, b = scene("a", "ok"), scene("b", "ok")
    specs = [ServerSpec.for_scene(s, lim) for s in (a, b) for lim in (False, True)]
    with Servers("m", specs, tmp_path) as servers:
        urls = [servers.url(s, lim)[0] for s in (a, b) for lim in (False, True)]
        assert len(set(urls)) == 4
        assert all(t.ready.is_set() and t.is_alive() for t in servers.threads)
        groups = [server_pid(url) for url in urls]
        time.sleep(0.5)  # the threads that started them still wait
        for url in urls:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                assert response.status == 200
        assert all(alive(pid) for pid in groups)
    assert not any(alive(pid) for pid in groups)
    assert (tmp_path / "a" / "stock" / "server.log").exists()
    assert (tmp_path / "b" / "limits" / "server.log").exists()


def server_pid(url: str) -> int:
    """The pid (and process group) of the fake server listening at ``url``."""
    port = url.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if FAKE_SERVER.encode() in cmdline and port.encode() in cmdline:
                return int(entry.name)
    raise LookupError(url)


@pytest.mark.usefixtures("fake_vllm")
def test_a_server_stopped_from_outside_is_named(tmp_path: Path) -> None:
    a = scene("a", "ok")
    specs = [ServerSpec.for_scene(a, lim) for lim in (False, True)]
    with Servers("m", specs, tmp_path) as servers:
        assert servers.stopped() == []
        url, _ = servers.url(a, True)
        os.killpg(server_pid(url), signal.SIGTERM)  # as another program might
        deadline = time.monotonic() + 10
        while not servers.stopped() and time.monotonic() < deadline:
            time.sleep(0.1)
        (line,) = servers.stopped()
        assert line.startswith("the with limits server of a stopped (exit -15;")


@pytest.mark.usefixtures("fake_vllm")
def test_one_failed_start_stops_the_others(tmp_path: Path) -> None:
    good, bad = scene("good", "ok"), scene("bad", "fail")
    specs = [ServerSpec.for_scene(good, False), ServerSpec.for_scene(bad, False)]
    before = threading.active_count()
    with (
        pytest.raises(server.ServerStartError, match="FATAL: no KV cache"),
        Servers("m", specs, tmp_path),
    ):
        pytest.fail("should not start")
    assert threading.active_count() == before  # every server thread ended


def test_a_server_spec_says_what_each_run_gets() -> None:
    s = scene("a", "--max-num-seqs", "4")
    stock, limited = ServerSpec.for_scene(s, False), ServerSpec.for_scene(s, True)
    assert stock.args == ["--max-num-seqs", "4", *COMMON_ARGS]
    assert stock.env == {"VLLM_PLUGINS": ""} and not stock.admin_key
    assert limited.args == [*stock.args, *s.limit_flags()]
    assert limited.env["VLLM_PLUGINS"] == "output_rate,output_rate_http"


def test_a_stock_run_drives_every_user_with_its_own_load(
    fake_server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = fake_server
    s = scene("a")
    seen.clear()
    played = play(s, url, "multi", ServerSpec.for_scene(s, False))
    assert played.engine is None and played.others.cores is not None
    light, hog = played.results["light"], played.results["hog"]
    assert light.spec.duration_s == pytest.approx(0.7)  # from 0.3 s to the end
    assert {r.stream for r in hog.records} == {0, 1, 2}
    # The engine's own count: every answer the clients got, none missing.
    answered = sum(r.ok for result in played.results.values() for r in result.records)
    assert played.tally.finished == answered > 0
    assert all(r.ok and r.engine_metrics == ENGINE_METRICS for r in light.records)
    users = {body["vllm_xargs"]["output_rate_user"] for body in seen}
    assert users == {"light", "hog"}
    figures = run_figures(s, played.results, None)
    assert figures.users["light"].ttft_engine_s == pytest.approx(0.0035)
    assert figures.users["hog"].rate_client > 0
