from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from harness.fake_openai_server import serving
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
def fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A scripted OpenAI-style streaming server (harness.fake_openai_server):
    its base URL and the request bodies it received."""
    with serving() as server:
        yield server
