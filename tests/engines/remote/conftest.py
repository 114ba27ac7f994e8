"""The remote engine's tests serve real tokenbelt upstreams with the server tests' fixture."""

from __future__ import annotations

from server.conftest import serve

__all__ = ["serve"]
