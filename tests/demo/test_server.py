"""demo/server.py's running_server, with a fake server command (no vLLM)."""

from __future__ import annotations

import copy
import os
import sys
import time
import urllib.request

import pytest

FAKE_SERVER = r"""
import http.server, pathlib, signal, subprocess, sys, time
port, mode = int(sys.argv[1]), sys.argv[2]
print("fake server starting", flush=True)
for i in range(60):
    print(f"log line {i}", flush=True)
if mode == "fail":
    print("FATAL: model not found", flush=True)
    sys.exit(3)
if mode == "busy-once":
    marker = pathlib.Path(sys.argv[3])
    if not marker.exists():
        marker.write_text("x")
        print("OSError: [Errno 98] Address already in use", flush=True)
        sys.exit(1)
child = "import signal, time\n"
if mode == "stubborn":
    child += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# An 'engine' process in the same process group.
subprocess.Popen([sys.executable, "-c", child + "time.sleep(300)"])
if mode == "hang":
    time.sleep(300)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_vllm(monkeypatch):
    from vllm_output_rate.demo import server

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
    return server


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


class TestServerHelper:
    def test_yields_url_and_stops_the_whole_group(self, fake_vllm, tmp_path):
        with fake_vllm.running_server("m", ["ok"], log_dir=tmp_path) as url:
            assert isinstance(url, str) and url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                assert response.status == 200
            assert "fake server starting" in url.log_text()
            assert url.log_path == tmp_path / "server.log"
            pgid = url.process.pid
            assert not group_gone(pgid)
            assert str(copy.deepcopy(url)) == url
        assert group_gone(pgid)

    def test_start_failure_shows_log_tail(self, fake_vllm):
        with (
            pytest.raises(fake_vllm.ServerStartError) as exc,
            fake_vllm.running_server("m", ["fail"]),
        ):
            pytest.fail("should not start")
        message = str(exc.value)
        assert "exited with code 3" in message
        assert "FATAL: model not found" in message
        assert "log line 59" in message and "log line 11" in message
        assert "log line 10" not in message  # only the last 50 lines

    def test_health_timeout(self, fake_vllm):
        with (
            pytest.raises(fake_vllm.ServerStartError, match="not healthy after 1 s"),
            fake_vllm.running_server("m", ["hang"], start_timeout_s=1),
        ):
            pytest.fail("should not start")

    def test_sigkill_after_stop_timeout(self, fake_vllm):
        with fake_vllm.running_server("m", ["stubborn"], stop_timeout_s=1) as url:
            pgid = url.process.pid
        t = time.monotonic()
        assert group_gone(pgid)
        assert time.monotonic() - t < 1

    def test_retries_when_port_is_taken(self, fake_vllm, tmp_path):
        args = ["busy-once", str(tmp_path / "marker")]
        with fake_vllm.running_server("m", args, log_dir=tmp_path) as url:
            assert url.log_path.name == "server.attempt2.log"
        assert "Address already in use" in (tmp_path / "server.log").read_text()
