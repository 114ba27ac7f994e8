"""The remote engine's tests serve real tokenbelt upstreams with the server tests' fixture,
real vLLM servers with ``vllm_fixture``'s (tests marked ``vllm``) and a real llama.cpp
``llama-server`` with ``llama_server_fixture``'s (tests marked ``llama_server``)."""

from __future__ import annotations

import pytest

from engines.remote.llama_server_fixture import llama_server, llama_server_binary
from engines.remote.vllm_fixture import vllms
from server.conftest import serve

__all__ = ["llama_server", "llama_server_binary", "serve", "vllms"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs against a real vLLM (TOKENBELT_VLLM=1; scripts/test's own step)"
    )
    config.addinivalue_line(
        "markers",
        "llama_server: runs against a real llama-server "
        "(TOKENBELT_LLAMA_SERVER=PATH or TOKENBELT_LLAMA_SERVER_BUILD=1)",
    )
