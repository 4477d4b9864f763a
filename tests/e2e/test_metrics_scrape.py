"""A metrics scrape stays the same size however many users are configured.

On a real server with the plugin's HTTP part, the user table grows through
the admin endpoint from 1,000 to 100,000 users with their own limit, and at
each size more distinct users send a request than there are recent-user
labels. The ``user`` label is bounded (the recent users, ``__anonymous__``
and ``__other__``), so the scrape keeps its labels and its size. Before the
bound, a scrape at 200,000 users was 13.5 MB and took 2.1 s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from vllm_output_rate.demo.server import RunningServer, running_server

pytestmark = pytest.mark.e2e

ADMIN_KEY = "test-admin-key"
RECENT_USERS = 20
TRAFFIC_USERS = 30  # per size: more than the recent labels
BOUND = RECENT_USERS + 2  # and __anonymous__, __other__
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_path: str) -> Iterator[RunningServer]:
    args = ["--default-user-output-tokens-per-second", "50"]
    args += ["--output-rate-metrics-recent-users", str(RECENT_USERS)]
    env = {
        "VLLM_PLUGINS": "output_rate,output_rate_http",
        "VLLM_OUTPUT_RATE_ADMIN_KEY": ADMIN_KEY,
    }
    with running_server(tiny_model_path, args, env=env, start_timeout_s=600) as url:
        yield url


def configure(url: str, start: int, stop: int) -> None:
    rates = {f"tenant-{i}": 5.0 + i % 7 for i in range(start, stop)}
    answer = httpx.put(
        url + "/v1/output_rate/limits",
        json={"user_output_tokens_per_second": rates},
        headers=ADMIN,
        timeout=600,
    )
    answer.raise_for_status()


def traffic(url: str, model: str, first: int) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(first, first + TRAFFIC_USERS):
            client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": "hi",
                    "max_tokens": 1,
                    "vllm_xargs": {"output_rate_user": f"tenant-{i}"},
                },
            ).raise_for_status()
    time.sleep(2.5)  # the API server polls the engine's counters at 1 Hz


def scrape(url: str) -> tuple[int, set[str]]:
    """The scrape's size in bytes and the ``user`` labels of ours."""
    body = httpx.get(url + "/metrics", timeout=120).text
    labels = {
        line.split('user="', 1)[1].split('"', 1)[0]
        for line in body.splitlines()
        if line.startswith("vllm:output_rate_") and 'user="' in line
    }
    return len(body.encode()), labels


def users_with_traffic(url: str) -> int:
    page = httpx.get(
        url + "/v1/output_rate/stats", params={"limit": "1000"}, headers=ADMIN
    ).json()
    assert page["next"] is None
    return len(page["users"])


def test_the_scrape_keeps_its_labels_and_size_from_1000_to_100000_users(
    server: RunningServer, tiny_model_path: str
) -> None:
    configure(server, 0, 1_000)
    traffic(server, tiny_model_path, 0)
    small_bytes, small_labels = scrape(server)
    configure(server, 1_000, 100_000)
    traffic(server, tiny_model_path, 1_000)
    large_bytes, large_labels = scrape(server)
    # Every recent slot was taken, and no label was added past the bound.
    assert RECENT_USERS <= len(small_labels) <= BOUND
    assert large_labels == small_labels
    assert large_bytes <= 1.1 * small_bytes
    # The users themselves are all still counted, beyond the labels.
    assert users_with_traffic(server) == 2 * TRAFFIC_USERS
