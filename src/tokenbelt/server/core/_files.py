"""Files a client sends inside a message, read as text: the Responses API's
``input_file`` and the chat API's ``file`` part, given inline as a base64 ``data:`` URL.

A text model reads a file whose media type is text (``text/*``, JSON, XML, YAML, TOML,
or none and a file name that says text): it sees the file's name, then its text. A PDF or
another document, a file by ``file_id`` or ``file_url`` (there is no Files API here, and
nothing is fetched) and bytes that are not UTF-8 are 400s that say which.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
from collections.abc import Mapping
from typing import Any

from ._errors import UnsupportedParameter

#: media types read as text, besides ``text/*``
TEXT_FILES = frozenset(
    {"application/json", "application/xml", "application/yaml", "application/x-yaml",
     "application/javascript", "application/x-sh", "application/toml"}
)  # fmt: skip


def file_text(fields: Mapping[str, Any], where: str, model: str) -> str:
    """The text of a file given as ``fields`` (``file_data``, ``filename``) at ``where``
    in the request, for ``model``: its name, a newline, its text."""
    extra = sorted(fields.keys() - {"file_data", "filename"})
    if extra:
        raise UnsupportedParameter(
            f"{where}.{extra[0]}",
            "tokenbelt reads a file given inline as file_data (a base64 data: URL); it has "
            "no Files API and fetches nothing",
        )
    data, name = fields.get("file_data"), fields.get("filename")
    if not isinstance(data, str) or not data.startswith("data:") or ";base64," not in data:
        raise UnsupportedParameter(f"{where}.file_data", "a base64 data: URL")
    head, _, body = data[len("data:") :].partition(";base64,")
    kind = head.split(";", 1)[0].strip().lower()
    if not kind and isinstance(name, str):
        kind = mimetypes.guess_type(name)[0] or ""
    if not (kind.startswith("text/") or kind in TEXT_FILES):
        raise UnsupportedParameter(
            f"{where}.file_data",
            f"a file of type {kind or 'unknown'!r}: {model} reads text files (text/*, JSON, "
            "XML, YAML) only; extract a PDF's or a document's text first",
        )
    try:
        text = base64.b64decode(body, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise UnsupportedParameter(f"{where}.file_data", f"not base64 UTF-8 text: {exc}") from exc
    return f"{name}:\n{text}" if isinstance(name, str) and name else text
