from __future__ import annotations

import pytest

from vllm_output_rate.demo.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The locally built tiny Llama (built once, then cached on disk)."""
    return str(build_tiny_model())
