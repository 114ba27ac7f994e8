"""httpx's one-call functions (``get``, ``post``, ``stream``...) without a certificate load
per call, for the plain-HTTP requests tests send to servers on 127.0.0.1.

Each ``httpx.get(...)`` builds a client, and each new client loads the system's CA bundle
into a new SSL context: about 65 ms of CPU on the 2-core test machine, for a request that
never uses TLS. These are the same calls (a new client and a new connection each, as
before) over one SSL context made once: in the suite they were minutes of CPU.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx

_TLS = ssl.create_default_context()


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, verify=_TLS, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=_TLS, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=_TLS, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.put(url, verify=_TLS, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.delete(url, verify=_TLS, **kwargs)


def stream(method: str, url: str, **kwargs: Any) -> Any:
    """``httpx.stream``: a context manager that yields the response."""
    return httpx.stream(method, url, verify=_TLS, **kwargs)


def options(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.options(url, verify=_TLS, **kwargs)
