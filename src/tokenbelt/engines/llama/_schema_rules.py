"""What llama-cpp-python's schema converter leaves out, as GBNF: numeric ranges and formats.

llama-cpp-python's Python converter (``llama_cpp.llama_grammar.SchemaConverter``) has no
integer ranges (llama.cpp's C++ converter does, ``_build_min_max_int``) and no formats
beyond date, time, date-time and uuid. ``Converter`` is that converter with:

- integer ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``, exactly
  (``integer_range``: the decimal strings of a range, digit by digit);
- integer ``multipleOf``, exactly when the range holds few multiples (they are listed)
  or has no bounds (the residues modulo the step, digit by digit);
- number bounds as far as a grammar can go: the sign and the integer part, no exponent;
- the formats email, hostname, ipv4, ipv6, duration and uri;
- a schema of annotations only (``description``...), or of them and keywords only
  validation checks (``not``...), as any JSON value;
- a ``maxLength`` or ``maxItems`` above ``MAX_REPEATED`` left out (checked after).

``audit`` walks a schema and sorts its keywords: what the grammar cannot enforce
exactly is checked after the reply (``checked_after``, validated with ``jsonschema``);
what neither can do raises ``InvalidArgument``, naming the keyword and where it is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ..._errors import InvalidArgument

#: integers have at most this many digits (as the converter's own integer rule)
MAX_DIGITS = 16
_BIG = 10**MAX_DIGITS - 1
#: a range with at most this many multiples of ``multipleOf`` lists them all
MAX_LISTED = 512
#: an unbounded ``multipleOf`` up to this step is a residue automaton (a rule per residue)
MAX_RESIDUES = 256

#: a ``maxLength`` or ``maxItems`` above this is left to validation: the converter spells a
#: bound out as that many optional rules (Claude Code's Workflow ``script`` has a
#: ``maxLength`` of 524,288, a grammar of megabytes), which llama.cpp expands again
MAX_REPEATED = 4096
_LIMITS = ("maxLength", "maxItems")
#: keywords the converter does not enforce and no rule here does: checked after the reply
_VALIDATED_ONLY = frozenset(
    {
        "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then",
        "else", "patternProperties", "propertyNames", "minProperties", "maxProperties",
        "dependentRequired", "dependentSchemas", "unevaluatedProperties",
        "unevaluatedItems",
    }
)  # fmt: skip
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: JSON Schema's annotations: they describe a value and constrain nothing
_ANNOTATIONS = frozenset(
    {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly"}
)  # fmt: skip


def _digits(lo: str, hi: str) -> str:
    """GBNF for the decimal strings from ``lo`` to ``hi``, both of one length."""
    if not lo:
        return ""
    n = len(lo) - 1
    if lo[0] == hi[0]:
        rest = _digits(lo[1:], hi[1:])
        return f'"{lo[0]}"' + (f" ({rest})" if rest else "")
    free = f" [0-9]{{{n}}}" if n > 1 else " [0-9]" if n == 1 else ""
    low_full, high_full = lo[1:] == "0" * n, hi[1:] == "9" * n
    first = int(lo[0]) + (0 if low_full else 1)
    last = int(hi[0]) - (0 if high_full else 1)
    alternatives = []
    if not low_full:
        alternatives.append(f'"{lo[0]}" ({_digits(lo[1:], "9" * n)})')
    if first <= last:
        alternatives.append(f"[{first}-{last}]{free}" if first < last else f'"{first}"{free}')
    if not high_full:
        alternatives.append(f'"{hi[0]}" ({_digits("0" * n, hi[1:])})')
    return " | ".join(alternatives)


def _magnitudes(lo: int, hi: int) -> str:
    """GBNF for the integers ``lo..hi`` (``0 <= lo <= hi``) written without a sign."""
    alternatives = []
    for length in range(len(str(lo)), len(str(hi)) + 1):
        start = max(lo, 10 ** (length - 1) if length > 1 else 0)
        end = min(hi, 10**length - 1)
        if start <= end:
            alternatives.append(f"({_digits(str(start), str(end))})")
    return " | ".join(alternatives)


def integer_range(lo: int | None, hi: int | None) -> str:
    """GBNF for the JSON integers from ``lo`` to ``hi`` (None: up to 16 digits), both ends
    included, without leading zeros and without ``-0``."""
    lo = -_BIG if lo is None else lo
    hi = _BIG if hi is None else hi
    if lo > hi:
        raise ValueError(f"no integer lies between {lo} and {hi}")
    alternatives = []
    if hi >= 0:
        alternatives.append(_magnitudes(max(lo, 0), hi))
    if lo < 0:
        alternatives.append(f'"-" ({_magnitudes(max(-hi, 1), -lo)})')
    return " | ".join(f"({a})" for a in alternatives)


def _listed(values: list[int]) -> str:
    return " | ".join(f'"{v}"' for v in values)


def _residues(step: int, name: str) -> tuple[str, dict[str, str]]:
    """GBNF for the multiples of ``step``: a rule per residue of what was read so far."""
    rules: dict[str, str] = {}
    for r in range(step):
        by_next: dict[int, list[int]] = {}
        for d in range(10):
            by_next.setdefault((10 * r + d) % step, []).append(d)
        alternatives = [
            f"[{''.join(map(str, ds))}] {name}-r{nxt}" for nxt, ds in sorted(by_next.items())
        ]
        if r == 0:
            alternatives.append('""')
        rules[f"{name}-r{r}"] = " | ".join(alternatives)
    first: dict[int, list[int]] = {}
    for d in range(1, 10):
        first.setdefault(d % step, []).append(d)
    start = " | ".join(f"[{''.join(map(str, ds))}] {name}-r{n}" for n, ds in sorted(first.items()))
    return f'"-"? ({start}) | "0"', rules


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    lo: int | None = None
    hi: int | None = None
    if "minimum" in schema:
        lo = math.ceil(Decimal(str(schema["minimum"])))
    if "exclusiveMinimum" in schema:
        bound = math.floor(Decimal(str(schema["exclusiveMinimum"]))) + 1
        lo = bound if lo is None else max(lo, bound)
    if "maximum" in schema:
        hi = math.floor(Decimal(str(schema["maximum"])))
    if "exclusiveMaximum" in schema:
        bound = math.ceil(Decimal(str(schema["exclusiveMaximum"]))) - 1
        hi = bound if hi is None else min(hi, bound)
    return lo, hi


def _integer_step(schema: dict[str, Any]) -> int | None:
    """``multipleOf`` as an integer step (None when absent or when every integer is one)."""
    step = schema.get("multipleOf")
    if step is None:
        return None
    exact = Decimal(str(step))
    if exact == exact.to_integral_value():
        return int(exact) if int(exact) > 1 else None
    inverse = 1 / exact
    if inverse == inverse.to_integral_value():  # 0.5, 0.25: every integer is a multiple
        return None
    return 0  # a step no integer grammar here expresses: checked after


def _step_exact(schema: dict[str, Any]) -> bool:
    """Whether an integer schema's ``multipleOf`` is enforced exactly (``Converter._integer``)."""
    step = _integer_step(schema)
    if step is None:
        return True
    if step == 0:
        return False
    lo, hi = _integer_bounds(schema)
    first, last = (-_BIG if lo is None else lo), (_BIG if hi is None else hi)
    listed = last // step - (first - 1) // step <= MAX_LISTED
    return listed or (lo is None and hi is None and step <= MAX_RESIDUES)


def _number_parts(schema: dict[str, Any]) -> str:
    """GBNF for a number whose sign and integer part lie within its bounds (no exponent);
    the fraction may still cross an end, which validation after the reply reports."""
    lo = hi = None
    for key in ("minimum", "exclusiveMinimum"):
        if key in schema:
            value = Decimal(str(schema[key]))
            lo = value if lo is None else max(lo, value)
    for key in ("maximum", "exclusiveMaximum"):
        if key in schema:
            value = Decimal(str(schema[key]))
            hi = value if hi is None else min(hi, value)
    exclusive_hi = "exclusiveMaximum" in schema and hi == Decimal(str(schema["exclusiveMaximum"]))
    exclusive_lo = "exclusiveMinimum" in schema and lo == Decimal(str(schema["exclusiveMinimum"]))
    fraction = '("." [0-9]{1,16})?'
    alternatives = []
    if hi is None or hi >= 0:
        top = _BIG if hi is None else math.floor(hi)
        if exclusive_hi and hi is not None and hi == top and top > 0:
            top -= 1
        bottom = 0 if lo is None or lo < 0 else math.floor(lo)
        if bottom <= top:
            alternatives.append(f"({_magnitudes(bottom, top)}) {fraction}")
    if lo is None or lo < 0:
        most = _BIG if lo is None else math.floor(-lo)
        if exclusive_lo and lo is not None and -lo == most and most > 0:
            most -= 1
        least = 0 if hi is None or hi >= 0 else math.floor(-hi)
        if least <= most:
            alternatives.append(f'"-" ({_magnitudes(least, most)}) {fraction}')
    if not alternatives:
        raise ValueError("no number lies within the bounds")
    return " | ".join(f"({a})" for a in alternatives)


# -- formats --------------------------------------------------------------------------------------

_LABEL = "[a-zA-Z0-9] ([a-zA-Z0-9-]{0,61} [a-zA-Z0-9])?"
_OCTET = '("25" [0-5] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [0-9])'
_H16 = "[0-9a-fA-F]{1,4}"


def _ipv6() -> str:
    """RFC 3986's IPv6address: eight groups, or fewer around one ``::``."""
    ls32 = f'({_H16} ":" {_H16} | ipv4-format)'
    full = f'({_H16} ":"){{6}} {ls32}'
    alternatives = [full]
    for right in range(6, -1, -1):  # groups after "::" (before the last 32 bits)
        tail = {
            6: f'({_H16} ":"){{5}} {ls32}',
            5: f'({_H16} ":"){{4}} {ls32}',
            4: f'({_H16} ":"){{3}} {ls32}',
            3: f'({_H16} ":"){{2}} {ls32}',
            2: f'{_H16} ":" {ls32}',
            1: ls32,
            0: _H16,
        }[right]
        left = 6 - right  # groups at most before "::"
        if right == 6:
            alternatives.append(f'"::" {tail}')
            continue
        head = f'({_H16} (":" {_H16}){{0,{left - 1}}})?' if left > 1 else f"({_H16})?"
        alternatives.append(f'{head} "::" {tail}')
    alternatives.append(f'({_H16} (":" {_H16}){{0,6}})? "::"')
    return " | ".join(f"({a})" for a in alternatives)


_DUR_N = "[0-9]{1,9}"
_FORMAT_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dns-label": (_LABEL, ()),
    "hostname-format": ('dns-label ("." dns-label){0,126}', ("dns-label",)),
    # a domain with a dot and a letters-only top-level label, as email validators ask
    # narrower than RFC 5321 (a 64-character local part, 63-character labels) so that a
    # small model cannot wander in an address for hundreds of tokens: three dotted local
    # parts of at most 24 characters, at most four domain labels of at most 24
    "email-format": (
        "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]{1,24} (\".\" [a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]{1,24}){0,2}"
        ' "@" (email-label "."){1,3} [a-zA-Z]{2,24}',
        ("email-label",),
    ),
    "email-label": ("[a-zA-Z0-9] ([a-zA-Z0-9-]{0,22} [a-zA-Z0-9])?", ()),
    "ipv4-format": (f'{_OCTET} "." {_OCTET} "." {_OCTET} "." {_OCTET}', ()),
    "ipv6-format": (_ipv6(), ("ipv4-format",)),
    "duration-format": (
        '"P" ( dur-date ("T" dur-time)? | "T" dur-time | ' + _DUR_N + ' "W" )',
        ("dur-date", "dur-time"),
    ),
    "dur-date": (
        f'{_DUR_N} "D" | {_DUR_N} "M" ({_DUR_N} "D")? | '
        f'{_DUR_N} "Y" ({_DUR_N} "M" ({_DUR_N} "D")?)?',
        (),
    ),
    "dur-time": (
        f'{_DUR_N} "H" ({_DUR_N} "M" ({_DUR_N} "S")?)? | {_DUR_N} "M" ({_DUR_N} "S")? | '
        f'{_DUR_N} "S"',
        (),
    ),
    # RFC 3986's characters after a scheme: unreserved, reserved and percent escapes
    "uri-format": (
        '[a-zA-Z] [a-zA-Z0-9+.-]{0,15} ":" '
        '([a-zA-Z0-9._~:/?#@!$&\'()*+,;=-] | "%" [0-9a-fA-F] [0-9a-fA-F])+',
        (),
    ),
}
#: the formats ``Converter`` adds to the converter's own
FORMATS = frozenset({"email", "hostname", "ipv4", "ipv6", "duration", "uri"})
#: the converter's own formats
CONVERTER_FORMATS = frozenset(
    {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
)


@functools.cache
def _converter_class() -> Any:
    # llama-cpp-python loads its native library at import: only when a schema compiles
    from llama_cpp import llama_grammar

    base: Any = llama_grammar.SchemaConverter  # untyped: its methods are Any here

    class Converter(base):  # type: ignore[misc]
        """llama-cpp-python's converter with the rules above (see the module docstring)."""

        def __init__(self) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)

        def _named(self, name: str) -> str:
            content, deps = _FORMAT_RULES[name]
            for dep in deps:
                self._named(dep)
            return str(self._add_rule(name, content))

        def visit(self, schema: dict[str, Any], name: str) -> str:
            kind = schema.get("type")
            rule = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
            if schema and not schema.keys() - _ANNOTATIONS - _VALIDATED_ONLY:
                # Any JSON value (Claude Code's Workflow ``args``; ``{"not": ...}`` alone,
                # which validation checks after); the converter asserts on it. A bare
                # ``{}`` stays the converter's object: tool parameters ``{}`` mean a call
                # with no arguments, and its arguments are an object.
                value = self._add_primitive("value", llama_grammar.PRIMITIVE_RULES["value"])
                return str(self._add_rule(rule, value))
            if any(_too_long(schema, k) for k in _LIMITS):
                schema = {k: v for k, v in schema.items() if not _too_long(schema, k)}
            plain = not any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum"))
            if plain and kind == "integer":
                lo, hi = _integer_bounds(schema)
                step = _integer_step(schema)
                if step or lo is not None or hi is not None:
                    return str(self._add_rule(rule, self._integer(lo, hi, step, rule) + " space"))
            if plain and kind == "number" and any(k in schema for k in _BOUNDS):
                return str(self._add_rule(rule, f"({_number_parts(schema)}) space"))
            fmt = schema.get("format")
            if plain and kind in (None, "string") and fmt in FORMATS and "pattern" not in schema:
                quoted = f'"\\"" {self._named(f"{fmt}-format")} "\\"" space'
                return str(self._add_rule(rule, quoted))
            return str(super().visit(schema, name))

        def _integer(self, lo: int | None, hi: int | None, step: int | None, rule: str) -> str:
            if step:
                first = -_BIG if lo is None else lo
                last = _BIG if hi is None else hi
                count = last // step - (first - 1) // step
                if count <= 0:
                    raise ValueError(f"no multiple of {step} lies between {first} and {last}")
                if count <= MAX_LISTED:
                    start = -(-first // step) * step
                    return f"({_listed(list(range(start, last + 1, step)))})"
                if lo is None and hi is None and step <= MAX_RESIDUES:
                    start, rules = _residues(step, f"{rule}-mod{step}")
                    for key, body in rules.items():
                        self._add_rule(key, body)
                    return f"({start})"
            return f"({integer_range(lo, hi)})"

    return Converter


def new_converter() -> Any:
    """llama-cpp-python's converter with the rules above (see the module docstring)."""
    return _converter_class()()


# -- what is enforced, what is checked after, what is refused ------------------------------------


@dataclass(frozen=True)
class Audit:
    """A schema's keywords the grammar does not enforce exactly, as ``keyword at path``."""

    checked_after: tuple[str, ...] = ()


def _too_long(schema: dict[str, Any], key: str) -> bool:
    limit = schema.get(key)
    return isinstance(limit, int) and limit > MAX_REPEATED


def _validator_formats() -> frozenset[str]:
    from jsonschema import Draft202012Validator  # type: ignore[import-untyped]

    return frozenset(Draft202012Validator.FORMAT_CHECKER.checkers)


def _inexact(schema: dict[str, Any]) -> list[str]:
    """The keywords of one schema node the grammar rules above leave to validation."""
    found = sorted(_VALIDATED_ONLY & schema.keys())
    kind = schema.get("type")
    plain = not any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum"))
    exact_integer = plain and kind == "integer"
    if not exact_integer:
        found += [k for k in _BOUNDS if k in schema]
    if "multipleOf" in schema and not (exact_integer and _step_exact(schema)):
        found.append("multipleOf")
    if ("format" in schema or "pattern" in schema) and kind in (None, "string"):
        found += [k for k in ("minLength", "maxLength") if k in schema]
        if "format" in schema and "pattern" in schema:
            found.append("format")
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS | CONVERTER_FORMATS:
        found.append("format")
    found += [k for k in _LIMITS if _too_long(schema, k) and k not in found]
    return found


def audit(schema: object, where: str = "") -> Audit:
    """Sort ``schema``'s keywords (see the module docstring); ``InvalidArgument`` names
    the first one neither the grammar nor validation can do."""
    notes: list[str] = []
    _walk(schema, where, notes, _validator_formats())
    return Audit(tuple(notes))


def _walk(schema: object, where: str, notes: list[str], checkable: frozenset[str]) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidArgument(f"a JSON schema must be an object (at {where or 'the top'})")
    at = where or "the top"
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS | CONVERTER_FORMATS | checkable:
        raise InvalidArgument(
            f"the JSON schema's format {fmt!r} (at {at}) can be neither enforced nor checked"
        )
    try:
        if schema.get("type") == "integer":
            lo, hi = _integer_bounds(schema)
            integer_range(lo, hi)
        elif schema.get("type") == "number" and any(k in schema for k in _BOUNDS):
            _number_parts(schema)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise InvalidArgument(f"the JSON schema's bounds (at {at}) admit no value: {exc}") from exc
    notes.extend(f"{keyword} at {at}" for keyword in _inexact(schema))
    path = f"{where}." if where else ""
    for key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, each in sub.items():
                _walk(each, f"{path}{key}.{name}", notes, checkable)
    for key in ("items", "additionalProperties", "contains", "not", "if", "then", "else"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            _walk(sub, f"{path}{key}", notes, checkable)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, each in enumerate(subs):
                _walk(each, f"{path}{key}[{i}]", notes, checkable)
