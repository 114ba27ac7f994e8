"""The remote engine's tests serve real tokenbelt upstreams with the server tests' fixture,
and real vLLM servers with ``vllm_fixture``'s (tests marked ``vllm``)."""

from __future__ import annotations

import pytest

from engines.remote.vllm_fixture import vllms
from server.conftest import serve

__all__ = ["serve", "vllms"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs against a real vLLM (TOKENBELT_VLLM=1; scripts/test's own step)"
    )
