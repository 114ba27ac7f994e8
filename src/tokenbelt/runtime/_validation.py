"""A finished reply checked against its whole JSON schema, with ``jsonschema``.

The grammar enforces most of a schema while the reply is sampled; what it cannot
enforce exactly (a number's fraction past its bound, ``uniqueItems``, a length beside a
format: the ``Audit`` of ``check_enforceable``) is checked here, once the reply is
complete, and reported rather than refused. Validators are kept per schema.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engines import check_enforceable

#: errors reported at most (a reply far off its schema would list many)
MAX_ERRORS = 8


@dataclass(frozen=True)
class SchemaCheck:
    """Whether a reply validated against its schema, and why not."""

    validated: bool
    errors: tuple[str, ...] = ()
    #: the schema's keywords the grammar left to this check (``keyword at path``)
    checked_after: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "validated": self.validated,
            "errors": list(self.errors),
            "checked_after": list(self.checked_after),
        }


@functools.lru_cache(maxsize=128)
def _validator(canonical: str) -> tuple[Any, tuple[str, ...]]:
    from jsonschema import validators  # type: ignore[import-untyped]

    schema = json.loads(canonical)
    cls = validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER), check_enforceable(schema).checked_after


def check_reply(schema: Mapping[str, Any], text: str, *, cut: bool = False) -> SchemaCheck:
    """Validate ``text`` (the reply's JSON) against ``schema``; never raises.

    ``cut``: the reply ended before its grammar did (``max_tokens``, a stop, a cancel).
    """
    validator, after = _validator(json.dumps(schema, separators=(",", ":")))
    if cut:
        return SchemaCheck(False, ("the reply was cut short before it was complete",), after)
    try:
        value = json.loads(text)
    except ValueError as exc:
        return SchemaCheck(False, (f"the reply is not JSON: {exc}",), after)
    errors = []
    for error in validator.iter_errors(value):
        where = "".join(f"[{p!r}]" for p in error.absolute_path) or "the reply"
        errors.append(f"{where}: {error.message}")
        if len(errors) == MAX_ERRORS:
            break
    return SchemaCheck(not errors, tuple(errors), after)
