"""The GBNF the schema converter lacks (integer ranges, multiples, number bounds, formats),
checked against llama.cpp's own grammar engine: each string is fed to the real grammar
sampler character by character, over the default model's vocabulary (no weights)."""

from __future__ import annotations

import ctypes
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tokenbelt import InvalidArgument
from tokenbelt.engines import Grammar, check_enforceable, load_vocab, schema_grammar
from tokenbelt.engines.llama._grammar import init_grammar_sampler
from tokenbelt.models import default_model_path

Accepts = Callable[[Grammar, str], bool]


@pytest.fixture(scope="module")
def accepts() -> Iterator[Accepts]:
    """Whether llama.cpp's grammar engine accepts a whole string (then the end)."""
    import llama_cpp as lib

    model = load_vocab(default_model_path())
    vocab = lib.llama_model_get_vocab(model.model)
    eos = lib.llama_vocab_eos(vocab)
    data = (lib.llama_token_data * 1)()
    array = lib.llama_token_data_array(data=data, size=1, selected=-1, sorted=False)
    samplers: dict[str, Any] = {}
    # one token per character: the grammar sees exactly the string, whatever the tokenizer
    by_char: dict[str, int] = {}

    def token(ch: str) -> int:
        if ch not in by_char:
            ids = model.tokenize(ch.encode(), False, False)
            assert len(ids) == 1, ch
            by_char[ch] = ids[0]
        return by_char[ch]

    def allowed(sampler: Any, tok: int) -> bool:
        data[0].id, data[0].logit, data[0].p = tok, 1.0, 0.0
        array.size, array.selected, array.sorted = 1, -1, False
        lib.llama_sampler_apply(sampler, ctypes.byref(array))
        return not math.isinf(data[0].logit)

    def check(grammar: Grammar, text: str) -> bool:
        sampler = samplers.get(grammar.gbnf)
        if sampler is None:
            sampler = samplers[grammar.gbnf] = init_grammar_sampler(lib, vocab, grammar)
        lib.llama_sampler_reset(sampler)
        for ch in text:
            tok = token(ch)
            if not allowed(sampler, tok):
                return False
            lib.llama_sampler_accept(sampler, tok)
        return allowed(sampler, eos)

    try:
        yield check
    finally:
        for sampler in samplers.values():
            lib.llama_sampler_free(sampler)
        model.close()


def around(*ends: int) -> list[int]:
    """Integers near each end and a spread between and beyond them."""
    rng = random.Random(0)
    values = {v + d for v in ends for d in range(-12, 13)}
    values |= {rng.randint(-(10**6), 10**6) for _ in range(60)}
    values |= {rng.randint(-1000, 1000) for _ in range(60)} | {0, 1, -1, 10, 99, 100, -100}
    return sorted(values)


RANGES = [
    {"minimum": 0, "maximum": 150},
    {"exclusiveMinimum": -1000, "exclusiveMaximum": 1000},
    {"minimum": -37, "maximum": -5},
    {"minimum": 7},
    {"maximum": -3},
    {"minimum": 100, "maximum": 100},
    {"minimum": 19, "maximum": 2031},
    {"exclusiveMinimum": 0},
    {"minimum": 0.5, "maximum": 9.5},
    {"minimum": 5, "exclusiveMinimum": 9, "maximum": 400, "exclusiveMaximum": 100},
]


@pytest.mark.parametrize("bounds", RANGES, ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items()))
def test_integer_ranges_are_exact(accepts: Accepts, bounds: dict[str, float]) -> None:
    schema = {"type": "integer", **bounds}
    assert check_enforceable(schema).checked_after == ()
    grammar = schema_grammar(schema)
    get = bounds.get
    lo = max(math.ceil(get("minimum", -1e30)), math.floor(get("exclusiveMinimum", -1e30)) + 1)
    hi = min(math.floor(get("maximum", 1e30)), math.ceil(get("exclusiveMaximum", 1e30)) - 1)
    ends = [int(v) for v in (lo, hi) if abs(v) < 1e20]
    for value in around(*ends):
        assert accepts(grammar, str(value)) is (lo <= value <= hi), value
    for never in ("007", "-0", "1.0", "1e2", "+5", ""):
        assert not accepts(grammar, never), never


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "multipleOf": 7},  # unbounded: residues
        {"type": "integer", "multipleOf": 25, "minimum": -300, "maximum": 1000},  # listed
        {"type": "integer", "multipleOf": 10, "exclusiveMinimum": 3},  # range, checked after
    ],
)
def test_integer_multiples(accepts: Accepts, schema: dict[str, Any]) -> None:
    grammar = schema_grammar(schema)
    step = schema["multipleOf"]
    lo = schema.get("minimum", schema.get("exclusiveMinimum", -(10**12)))
    exact = check_enforceable(schema).checked_after == ()
    lo += 1 if "exclusiveMinimum" in schema else 0
    hi = schema.get("maximum", 10**12)
    for value in around(*(v for v in (lo, hi, 0) if abs(v) < 10**12)):
        ok = lo <= value <= hi and value % step == 0
        if exact:
            assert accepts(grammar, str(value)) is ok, value
        elif ok:
            assert accepts(grammar, str(value)), value  # never stricter than the schema
    assert exact is ("exclusiveMinimum" not in schema)


def test_number_bounds_hold_the_sign_and_the_integer_part(accepts: Accepts) -> None:
    schema = {"type": "number", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000}
    grammar = schema_grammar(schema)
    for yes in ("0", "999.99", "-999.5", "-0.25", "12"):
        assert accepts(grammar, yes), yes
    for no in ("1000", "-1000", "1000.5", "1e9", "-1200"):
        assert not accepts(grammar, no), no
    assert check_enforceable(schema).checked_after == (
        "exclusiveMinimum at the top",
        "exclusiveMaximum at the top",
    )
    positive = schema_grammar({"type": "number", "minimum": 0})
    assert not accepts(positive, "-1")
    assert accepts(positive, "3.5")


FORMATS = {
    "email": (["a@b.co", "jane.doe+x@mail.example.org"], ["a@b", "@b.co", "a b@c.de", "a@b.c0"]),
    "hostname": (["localhost", "a-b.example.com"], ["-a.com", "a..b", "a_b.com"]),
    "ipv4": (["0.0.0.0", "192.168.1.255"], ["256.1.1.1", "1.2.3", "01.2.3.4x"]),
    "ipv6": (
        ["::", "::1", "fe80::1:2", "1:2:3:4:5:6:7:8", "::ffff:1.2.3.4"],
        ["1:2", ":::", "g::", "1:2:3:4:5:6:7:8:9"],
    ),
    "duration": (["P3D", "PT1H30M", "P1Y2M", "P2W"], ["P", "PT", "3D", "P1H"]),
    "uri": (["https://example.com/a?b=c#d", "urn:isbn:123"], ["example", "://x", "http://a b"]),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats(accepts: Accepts, fmt: str) -> None:
    grammar = schema_grammar({"type": "string", "format": fmt})
    good, bad = FORMATS[fmt]
    for text in good:
        assert accepts(grammar, f'"{text}"'), text
    for text in bad:
        assert not accepts(grammar, f'"{text}"'), text


def test_what_the_grammar_leaves_is_checked_after_and_the_rest_is_refused() -> None:
    audit = check_enforceable(
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                "site": {"type": "string", "format": "uri", "maxLength": 2083},
                "price": {"type": "number", "multipleOf": 0.01},
            },
        }
    )
    assert audit.checked_after == (
        "uniqueItems at properties.tags",
        "maxLength at properties.site",
        "multipleOf at properties.price",
    )
    with pytest.raises(InvalidArgument, match=r"format 'credit-card' \(at properties.c\)"):
        check_enforceable({"properties": {"c": {"type": "string", "format": "credit-card"}}})
    with pytest.raises(InvalidArgument, match="admit no value"):
        schema_grammar({"type": "integer", "minimum": 5, "maximum": 4})


def test_a_schema_of_annotations_only_is_any_json_value(accepts: Accepts) -> None:
    # Claude Code's Workflow tool: ``"args": {"description": "..."}``, any value at all.
    grammar = schema_grammar({"description": "any value", "title": "args"})
    for text in ('{"a": [1, null]}', "[1, 2]", '"text"', "3.5", "true", "null"):
        assert accepts(grammar, text), text
    assert not accepts(grammar, "{")
    assert check_enforceable({"description": "any value"}).checked_after == ()
    # A bare {} stays the converter's object (a tool's parameters without arguments).
    assert not accepts(schema_grammar({}), "[1]")


def test_a_bound_too_long_to_spell_out_is_checked_after(accepts: Accepts) -> None:
    # Claude Code's Workflow ``script``: a maxLength of 524,288 was a 4 MB grammar.
    schema = {"type": "string", "minLength": 2, "maxLength": 524_288}
    grammar = schema_grammar(schema)
    assert len(grammar.gbnf) < 2000
    assert accepts(grammar, '"' + "x" * 5000 + '"')
    assert not accepts(grammar, '"x"')  # the minimum is still the grammar's
    items = {"type": "array", "items": {"type": "integer"}, "maxItems": 100_000}
    assert len(schema_grammar(items).gbnf) < 2000
    audit = check_enforceable({"properties": {"s": schema, "i": items}})
    assert audit.checked_after == ("maxLength at properties.s", "maxItems at properties.i")
    assert check_enforceable({"type": "string", "maxLength": 4096}).checked_after == ()
