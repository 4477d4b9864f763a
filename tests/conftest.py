from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from harness.fake_openai_server import serving
from harness.redis_server import RedisServer
from vllm_output_rate.demo.tiny_model import build_tiny_model

# Property tests check behaviour, never speed: on these shared 2-core machines
# one example can take longer than hypothesis' default 200 ms deadline.
settings.register_profile("project", deadline=None)
settings.load_profile("project")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The locally built tiny Llama (built once, then cached on disk)."""
    return str(build_tiny_model())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on 127.0.0.1 (random port) for the whole session.

    Tests keep apart by key prefix (``store_prefix``); a test that stops or
    kills the server starts its own ``RedisServer`` instead.
    """
    with RedisServer() as server:
        yield server


@pytest.fixture
def store_prefix(request: pytest.FixtureRequest) -> str:
    return f"test-{request.node.name}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="session")
def fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A scripted OpenAI-style streaming server (harness.fake_openai_server):
    its base URL and the request bodies it received."""
    with serving() as server:
        yield server
