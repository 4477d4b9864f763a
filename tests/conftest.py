from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from harness.redis_server import RedisServer
from vllm_output_rate.demo.tiny_model import build_tiny_model


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
