"""Remote models in the user catalog: entries of kind ``remote``.

::

    {"alias": "big", "kind": "remote", "url": "http://gpu-1:8000",
     "model": "meta-llama/Llama-3.1-8B-Instruct", "api_key_env": "VLLM_KEY",
     "headers": {"x-team": "search"}, "max_concurrency": 16}

``url`` is one base URL or a list of them (every one serves ``model``; requests are
routed between them). The API key itself never goes in the file: ``api_key_env``
names the environment variable that holds it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import CatalogError, InvalidArgument
from ..engines import Upstream
from ._catalog import NAME_PATTERN, Catalog, read_user_catalog_json
from ._home import Home
from ._registry import _lock, _write_catalog
from ._sources import Fields

KIND = "remote"


@dataclass(frozen=True)
class RemoteEntry:
    """A model served elsewhere, by one or more OpenAI-compatible servers."""

    alias: str
    urls: tuple[str, ...]
    model: str
    api_key_env: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    max_concurrency: int = 4

    def upstreams(self) -> list[Upstream]:
        """The upstreams to route between; the API key is read from the environment now."""
        key = None
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise InvalidArgument(
                    f"remote model {self.alias}: the environment variable "
                    f"{self.api_key_env} (its API key) is not set"
                )
        return [
            Upstream(u, self.model, api_key=key, headers=self.headers,
                     max_concurrency=self.max_concurrency)
            for u in self.urls
        ]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "alias": self.alias,
            "kind": KIND,
            "url": self.urls[0] if len(self.urls) == 1 else list(self.urls),
            "model": self.model,
        }
        if self.api_key_env:
            out["api_key_env"] = self.api_key_env
        if self.headers:
            out["headers"] = dict(self.headers)
        out["max_concurrency"] = self.max_concurrency
        return out


def is_remote(data: object) -> bool:
    return isinstance(data, dict) and data.get("kind") == KIND


def parse_remote_entry(data: object, file: Path | str, where: str) -> RemoteEntry:
    """Validate one remote entry; raises ``CatalogError`` naming ``file`` and the field."""
    f = Fields(data, file, where)
    alias = f.need_text("alias", check=NAME_PATTERN.match, expected="a name of letters, digits")
    f.where = f"{where} ({alias})"
    raw = f.data.get("url")
    urls = [raw] if isinstance(raw, str) else raw
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
        f.fail('"url" must be a base URL or a list of them', "url")
    headers = f.data.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        f.fail('"headers" must map names to strings', "headers")
    limit = f.data.get("max_concurrency", 4)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        f.fail('"max_concurrency" must be an integer >= 1', "max_concurrency")
    entry = RemoteEntry(
        alias=alias,
        urls=tuple(urls),
        model=f.need_text("model"),
        api_key_env=f.text("api_key_env", required=False),
        headers=dict(headers),
        max_concurrency=limit,
    )
    try:
        for u in entry.urls:
            Upstream(u, entry.model)
    except InvalidArgument as exc:
        f.fail(str(exc), "url")
    return entry


def remote_entries(home: Home | None = None) -> dict[str, RemoteEntry]:
    """The user catalog's remote models by alias."""
    home = home or Home.from_env()
    path = home.catalog_file
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CatalogError(f"{path}: cannot read the catalog: {exc}") from exc
    models = data.get("models", []) if isinstance(data, dict) else []
    return {
        e.alias: e
        for e in (
            parse_remote_entry(m, path, f"models[{i}]")
            for i, m in enumerate(models)
            if is_remote(m)
        )
    }


def find_remote(alias: str, home: Home | None = None) -> RemoteEntry | None:
    return remote_entries(home).get(alias)


def add_remote(entry: RemoteEntry, *, replace: bool = False, home: Home | None = None) -> None:
    """Write ``entry`` into the user catalog; an alias in use needs ``replace``."""
    home = home or Home.from_env()
    parse_remote_entry(entry.to_json(), "the new entry", "remote")
    with _lock(home):
        taken = entry.alias in Catalog.load(home) or entry.alias in remote_entries(home)
        if taken and not replace:
            raise CatalogError(
                f"the alias {entry.alias!r} is already in the catalog (give --replace)"
            )
        data = read_user_catalog_json(home.catalog_file)
        data["models"] = [m for m in data["models"] if m.get("alias") != entry.alias]
        data["models"].append(entry.to_json())
        _write_catalog(home.catalog_file, data)
