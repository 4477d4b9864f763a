"""What the server benchmarks measure besides the load generator's own
figures: CPU seconds of a server's processes, whether a server has drained,
client-side token counts from a load's records, and the two statistics
every benchmark reports (median, quartiles). How busy the rest of the
machine is: ``noise``."""

from __future__ import annotations

import contextlib
import math
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx
import psutil

from vllm_output_rate.demo.server import RunningServer
from vllm_output_rate.loadtest import LoadResult
from vllm_output_rate.loadtest.summary import percentile

# ----- process CPU -----------------------------------------------------------


def server_processes(url: RunningServer) -> dict[str, Any]:
    """role -> psutil.Process for a server's process tree.

    Roles: ``api_server`` (the group leader), ``engine_core`` (process title
    ``VLLM::EngineCore``: scheduler and engine loop), ``worker``
    (``VLLM::Worker...``: runs the model), ``other`` (helpers)."""
    leader = psutil.Process(url.process.pid)
    roles: dict[str, Any] = {"api_server": leader}
    for child in leader.children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "EngineCore" in title:
            roles["engine_core"] = child
        elif "Worker" in title:
            roles.setdefault("worker", child)
        else:
            roles.setdefault("other", child)
    if "engine_core" not in roles:
        raise RuntimeError(f"no EngineCore process found under pid {leader.pid}")
    return roles


def cpu_seconds(processes: dict[str, Any]) -> dict[str, float]:
    """role -> user + system CPU seconds so far."""
    out = {}
    for role, proc in processes.items():
        times = proc.cpu_times()
        out[role] = times.user + times.system
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def wait_until_drained(url: str, timeout_s: float = 30.0) -> bool:
    """Wait until the server has no running or waiting request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            totals = metric_totals(url)
            busy = totals.get("vllm:num_requests_running", 0.0) + totals.get(
                "vllm:num_requests_waiting", 0.0
            )
            if busy == 0:
                return True
        time.sleep(0.5)
    return False


# ----- client-side counts and statistics -------------------------------------


def tokens_between(result: LoadResult, user: str | None, lo: float, hi: float) -> int:
    return sum(
        n
        for r in result.records
        if r.user == user
        for t, n in r.chunks
        if lo <= t <= hi
    )


def median_us(samples_ns: Sequence[int]) -> float:
    """Median of timings in ns, in µs (the scheduler benchmarks' unit)."""
    return statistics.median(samples_ns) / 1e3


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def quartiles(values: Sequence[float | None]) -> tuple[float, float]:
    """First and third quartile of the values that are numbers (NaN, NaN if
    none)."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return float("nan"), float("nan")
    return percentile(xs, 25), percentile(xs, 75)


def metric_totals(url: str) -> dict[str, float]:
    """Every ``vllm:`` metric on the server's ``/metrics``, summed over its
    labels."""
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            name, _, value = match.groups()
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals
