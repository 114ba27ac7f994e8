"""What an API answer says of the machine it runs on: no absolute path of the server's
files (a model's, a cache's) unless the admin key asked.

A path tells a caller the user's name and the layout of the machine; the model's file
name is all a client needs. ``public`` walks an answer: a ``path`` entry is dropped and
every absolute path inside a string is cut to its last part. The admin key (``--admin-key``)
sees answers whole.
"""

from __future__ import annotations

import re
from typing import Any

from ._middleware import CALLER

#: an absolute POSIX path (not the path part of a URL): the last part is kept
_ABSOLUTE = re.compile(r"(?<![\w.:/~-])(?:/[^/\s'\"`]+)+/([^/\s'\"`]+)")


def admin_asked() -> bool:
    """True when the request being served came with the admin key."""
    caller = CALLER.get()
    return caller is not None and caller.admin


def scrub(text: str) -> str:
    """``text`` with each absolute path cut to its last part (unless the admin asked)."""
    if admin_asked() or "/" not in text:
        return text
    return _ABSOLUTE.sub(r"\1", text)


def public(value: Any) -> Any:
    """``value`` (an answer's JSON) without ``path`` entries and with every string
    ``scrub``\\ bed; as it is for the admin key."""
    if admin_asked():
        return value
    return _public(value)


def _public(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if k != "path"}
    if isinstance(value, list | tuple):
        return [_public(v) for v in value]
    return value
