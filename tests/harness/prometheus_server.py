"""A real Prometheus server for tests (Debian's ``prometheus`` package).

``running_prometheus(["127.0.0.1:8000"])`` starts it on a free port of
127.0.0.1, scraping those targets every second, with its data in a fresh
temporary folder, and yields a ``Prometheus`` to query; on exit it is
stopped. ``make test`` installs the package (``make test-servers``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.demo.server import free_port, log_tail, stop_process_group

BINARY = "prometheus"
START_TIMEOUT_S = 60.0


class Prometheus:
    def __init__(self, url: str, log_path: Path) -> None:
        self.url = url
        self.log_path = log_path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector; raises with Prometheus' error."""
        answer = httpx.get(self.url + "/api/v1/query", params={"query": expr}).json()
        if answer.get("status") != "success":
            raise AssertionError(f"{expr!r}: {answer.get('error', answer)}")
        return list(answer["data"]["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        answer = httpx.get(
            f"{self.url}/api/v1/label/{label}/values", params={"match[]": match}
        ).json()
        assert answer["status"] == "success", answer
        return list(answer["data"])

    def wait_for_scrapes(self, count: int, timeout_s: float = 60.0) -> None:
        """Until every target was scraped ``count`` times, up and healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            samples = self.query(f"count_over_time(up[{count + 5}s])")
            healthy = self.query("min(up)")
            if (
                samples
                and min(float(s["value"][1]) for s in samples) >= count
                and healthy
                and float(healthy[0]["value"][1]) == 1
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"Prometheus did not scrape {count} times:\n{self.log()}")

    def log(self) -> str:
        return log_tail(self.log_path)


@contextlib.contextmanager
def running_prometheus(
    targets: Sequence[str], scrape_interval_s: float = 1.0
) -> Iterator[Prometheus]:
    binary = shutil.which(BINARY)
    if binary is None:
        raise RuntimeError(
            "the prometheus binary is not installed: `make test-servers` "
            "(Debian package prometheus) installs it"
        )
    folder = Path(tempfile.mkdtemp(prefix="prometheus-"))
    config = folder / "prometheus.yml"
    interval = f"{scrape_interval_s:g}s"
    config.write_text(
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        "scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
        f"      - targets: {list(targets)!r}\n".replace("'", '"')
    )
    port = free_port()
    log_path = folder / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not start:\n{log_tail(log_path)}")
            time.sleep(0.2)
        yield Prometheus(url, log_path)
    finally:
        stop_process_group(process, 10.0)
