"""What an OpenAI-compatible server serves: ``GET /v1/models``, once, before serving."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..._errors import UpstreamUnavailable


@dataclass(frozen=True)
class UpstreamModel:
    """One model an upstream lists: its name there and what it says about it."""

    url: str
    name: str
    context_length: int
    #: the upstream is a tokenbelt server
    tokenbelt: bool


def _context_length(entry: Mapping[str, object]) -> int:
    """vLLM says ``max_model_len``; tokenbelt ``tokenbelt.context_length``."""
    extension = entry.get("tokenbelt")
    nested = extension.get("context_length") if isinstance(extension, dict) else None
    for value in (entry.get("max_model_len"), entry.get("context_length"), nested):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def list_models(
    url: str, *, headers: Mapping[str, str] | None = None, timeout: float = 10.0
) -> list[UpstreamModel]:
    """The models ``url`` serves (blocking). A tokenbelt upstream's catalog aliases that
    it has not loaded are left out: it would answer 404 for them.

    Raises ``UpstreamUnavailable`` with the cause when the upstream cannot be asked.
    """
    import httpx  # on first use: most processes never list an upstream's models

    base = url.rstrip("/").removesuffix("/v1")
    try:
        answer = httpx.get(f"{base}/v1/models", headers=dict(headers or {}), timeout=timeout)
    except httpx.HTTPError as exc:
        raise UpstreamUnavailable(
            f"cannot list the models of {base}: {type(exc).__name__}: {exc}"
        ) from exc
    if answer.status_code != 200:
        raise UpstreamUnavailable(
            f"{base}/v1/models answered {answer.status_code}: {answer.text[:200]}",
            status=answer.status_code,
        )
    try:
        data = answer.json().get("data")
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        raise UpstreamUnavailable(f"{base}/v1/models did not answer an OpenAI model list")
    out = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        extension = entry.get("tokenbelt")
        tokenbelt = isinstance(extension, dict)
        if isinstance(extension, dict) and extension.get("state") == "available":
            continue
        out.append(UpstreamModel(base, entry["id"], _context_length(entry), tokenbelt))
    return out
