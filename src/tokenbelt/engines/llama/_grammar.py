"""Grammars that constrain sampling: JSON schemas compiled to GBNF, and the sampler step.

A ``Grammar`` is plain text (GBNF, llama.cpp's grammar format) carried by the request,
so a request with a grammar pickles like any other. ``schema_grammar`` compiles a JSON
schema with llama-cpp-python's converter (``json_schema_to_gbnf``), measured and kept in
an LRU cache keyed by the schema's compact JSON (key order kept: it is the output's).
The engine checks that a grammar parses against its vocabulary before the request is
queued, so a bad one costs no compute.

``GrammarSampler`` runs llama.cpp's grammar sampler the way llama.cpp's own common
sampler does: sample the token without the grammar, check that one token against the
grammar, and only when the grammar rejects it apply the grammar to the whole
vocabulary and sample again. Most tokens pass the cheap check, so a constrained stream
decodes almost as fast as a free one. A lazy grammar that awaits its trigger allows
every token, so until then the token is llama.cpp's own plain sample
(``llama_sampler_sample``, as without a grammar): the grammar only sees it accepted,
which is where its trigger is checked.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..._errors import DecodeError, InvalidArgument
from .._request import Grammar
from ._binding import quiet_native_logs
from ._schema_rules import Audit, audit, new_converter

#: schemas kept compiled (their GBNF text)
SCHEMA_CACHE_SIZE = 128


@dataclass(frozen=True)
class GrammarCacheInfo:
    """The schema cache's counters (a snapshot)."""

    hits: int
    misses: int
    size: int
    #: total seconds spent compiling schemas
    compile_s: float


#: the converter's string characters let raw control characters through, which JSON
#: forbids inside a string (a reply with a raw newline in a string would not parse);
#: its pattern ``.`` lets through a raw quote too
_LAX_RULES = {
    'char ::= [^"\\\\] |': 'char ::= [^"\\\\\\x00-\\x1F\\x7F] |',
    "dot ::= [^\\x0A\\x0D]": 'dot ::= [^"\\\\\\x00-\\x1F\\x7F]',
}


def _json_safe(gbnf: str) -> str:
    """The converter's grammar with string characters JSON allows unescaped, only."""
    for lax, strict in _LAX_RULES.items():
        gbnf = gbnf.replace(lax, strict)
    return gbnf


def _binding() -> None:
    """Import llama-cpp-python as the engines do: its native log lines go to ``logging``
    and the files it opens at import are closed at exit (a process may compile schemas
    before, or without, loading a model)."""
    quiet_native_logs()


class _SchemaCache:
    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._compile_s = 0.0
        self._compile = functools.lru_cache(maxsize=size)(self._convert)

    def _convert(self, canonical: str) -> tuple[str, float]:
        _binding()
        started = time.perf_counter()
        schema = for_converter(json.loads(canonical))
        check_enforceable(schema)
        try:
            converter = new_converter()
            converter.visit(converter.resolve_refs(schema, "stdin"), "")
            gbnf = _json_safe(converter.format_grammar())
        except Exception as exc:  # the converter asserts on what it cannot express
            raise InvalidArgument(
                f"the JSON schema cannot be compiled to a grammar: {exc}"
            ) from exc
        elapsed = time.perf_counter() - started
        with self._lock:
            self._compile_s += elapsed
        return gbnf, elapsed

    def grammar(self, schema: object) -> Grammar:
        canonical = canonical_schema(schema)
        before = self._compile.cache_info().hits
        gbnf, elapsed = self._compile(canonical)
        cached = self._compile.cache_info().hits > before
        return Grammar(gbnf, compile_s=0.0 if cached else elapsed, cached=cached)

    def info(self) -> GrammarCacheInfo:
        ci = self._compile.cache_info()
        with self._lock:
            return GrammarCacheInfo(ci.hits, ci.misses, ci.currsize, self._compile_s)

    def clear(self) -> None:
        self._compile.cache_clear()
        with self._lock:
            self._compile_s = 0.0


_CACHE = _SchemaCache(SCHEMA_CACHE_SIZE)


#: an item schema that allows any JSON value, as ``{}`` and ``true`` do: llama-cpp-python's
#: converter reads a falsy ``items`` as absent (and then wants ``prefixItems``)
ANY_ITEM = {"description": "any JSON value"}


def for_converter(schema: Any) -> Any:
    """``schema`` as the converter can take it, meaning the same: an array's ``items`` of
    ``{}`` or ``true`` (pydantic writes ``{}`` for a bare ``list``), or none beside
    ``minItems``/``maxItems``, becomes ``ANY_ITEM``, so the bounds are kept; a root that is
    only a ``$ref`` into its own ``$defs`` (pydantic's recursive models) becomes the
    definition it names, its ``$defs`` kept for the references inside."""
    schema = _any_items(schema)
    if isinstance(schema, dict) and isinstance(ref := schema.get("$ref"), str):
        target = _pointer(schema, ref)
        if isinstance(target, dict) and "$ref" not in target:
            schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **target}
    return schema


def _any_items(node: Any) -> Any:
    if isinstance(node, list):
        return [_any_items(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _any_items(v) for k, v in node.items()}
    items = out.get("items")
    bounded = out.get("type") == "array" and ("minItems" in out or "maxItems" in out)
    if (
        items is True
        or items == {}
        or (bounded and "items" not in out and "prefixItems" not in out)
    ):
        out["items"] = dict(ANY_ITEM)
    return out


def _pointer(document: dict[str, Any], ref: str) -> Any:
    """What a local ``#/a/b`` reference names in ``document`` (None: nothing)."""
    if not ref.startswith("#/"):
        return None
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_enforceable(schema: object, where: str = "") -> Audit:
    """What of ``schema`` the grammar leaves to validation after the reply (``Audit``);
    raises ``InvalidArgument`` naming the first keyword neither can do."""
    return audit(schema, where)


def canonical_schema(schema: object) -> str:
    """The schema as compact JSON: the cache's key and the converter's input.

    Keys keep their order: the order of ``properties`` is the order of the output.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidArgument(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidArgument(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"the JSON schema is not JSON: {exc}") from exc


def schema_grammar(schema: object) -> Grammar:
    """The grammar of a JSON schema (a dict or its JSON text); cached per schema.

    Raises ``InvalidArgument`` when the schema uses what the converter cannot express.
    """
    return _CACHE.grammar(schema)


def json_object_grammar() -> Grammar:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return _CACHE.grammar({"type": "object"})


#: what a call's JSON starts with, after the opening tag (its name comes next)
CALL_PREFIX = '{"name": "'
#: what separates a call's name from its arguments
CALL_ARGUMENTS = '", "arguments": '


def call_arguments(key: str) -> str:
    """What separates a call's name from its arguments when they are under ``key``
    (``arguments`` in most families, ``parameters`` in Llama 3.x's)."""
    return f'", "{key}": '


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _regex_escape(text: str) -> str:
    """``text`` as an ECMAScript regex that matches it literally."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}/" else c for c in text)


def _regex_prefixes(text: str) -> str:
    """An ECMAScript regex matching any prefix of ``text`` (the empty one too)."""
    return _atoms_prefixes([_regex_escape(ch) for ch in text])


def _atoms_prefixes(atoms: list[str]) -> str:
    """An ECMAScript regex matching any prefix of the sequence of regex ``atoms``."""
    out = ""
    for atom in reversed(atoms):
        out = f"(?:{atom}{out})?"
    return out


def _definitions(schema: object) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    return {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}


@functools.lru_cache(maxsize=SCHEMA_CACHE_SIZE)
def _functions_gbnf(canonical: str) -> tuple[str, tuple[str, ...], float]:
    _binding()
    head, tail, functions, answer, key, marker, optional_head = json.loads(canonical)
    started = time.perf_counter()
    converter = new_converter()
    calls = []
    defined: dict[str, tuple[str, object]] = {}
    named = [*functions, *([["the response_format", answer]] if answer is not None else [])]
    for name, schema in named:
        # The converter names a definition's rule after it, once for the whole grammar.
        for ref, sub in _definitions(schema).items():
            first = defined.setdefault(ref, (name, sub))
            if first[1] != sub:
                raise InvalidArgument(
                    f"functions {first[0]!r} and {name!r} define {ref!r} differently; "
                    "rename one of them"
                )
    separator = call_arguments(key)
    for i, (name, schema) in enumerate(functions):
        check_enforceable(schema, f"function {name}")
        try:
            resolved = converter.resolve_refs(schema, f"function-{i}")
            args = converter.visit(resolved, f"function-{i}-arguments")
        except Exception as exc:  # the converter asserts on what it cannot express
            raise InvalidArgument(
                f"the parameters of function {name!r} cannot be compiled to a grammar: {exc}"
            ) from exc
        calls.append(f"{_literal(name + separator)} {args}")
    reply = ""
    if answer is not None:  # the reply is a call or the answer's JSON
        check_enforceable(answer, "response_format")
        try:
            reply = " | " + converter.visit(converter.resolve_refs(answer, "answer"), "answer")
        except Exception as exc:  # the converter asserts on what it cannot express
            raise InvalidArgument(
                f"the response_format's schema cannot be compiled to a grammar: {exc}"
            ) from exc
    rules = _json_safe(converter.format_grammar())
    call = " | ".join(f"({c})" for c in calls)
    opening = f"({_literal(head)})?" if optional_head else _literal(head)
    closing = f" {_literal(tail)}" if tail else ""
    root = f'root ::= {opening} "\\n"? {_literal(CALL_PREFIX)} ({call}) "}}"{closing}' + reply
    # The trigger fires when the output ends in the marker and whatever of the call's
    # start one token may carry past it: the grammar takes over from the marker on.
    # llama.cpp searches each pattern in all the free text so far, on every token (one
    # that is ^...$ it matches whole instead): a pattern that starts with the marker is
    # a cheap scan, where a leading [\s\S]*? made each token cost quadratic time in the
    # text before it (8.7 ms a token after 200 tokens, measured).
    after = [_regex_escape(c) for c in head[len(marker) :]] + ["\\n?"]
    after += [_regex_escape(c) for c in CALL_PREFIX]
    triggers = ["(" + _regex_escape(marker) + _atoms_prefixes(after) + ")$"]
    if optional_head:  # the call may be the whole reply without its head: JSON first
        rest = _regex_prefixes(CALL_PREFIX[1:])
        triggers.append("^\\s*(" + _regex_escape(CALL_PREFIX[0]) + rest + ")$")
    return f"{rules}\n{root}\n", tuple(triggers), time.perf_counter() - started


def functions_grammar(
    functions: list[tuple[str, object]],
    *,
    head: str,
    tail: str,
    lazy: bool,
    answer: object = None,
    key: str = "arguments",
    marker: str | None = None,
    optional_head: bool = False,
) -> Grammar:
    """A grammar for exactly one call ``head{"name": "f", "<key>": {...}}tail`` of one of
    ``functions`` (name, JSON schema of its arguments); cached per function set and shape.

    ``answer`` (a JSON schema, not with ``lazy``): the reply is either the call or JSON
    matching it (``response_format`` beside ``tools``). ``tail`` may be empty (the call
    ends the reply: Llama 3.x). ``optional_head``: the call may come without ``head``.

    ``lazy``: text is free until the output ends in ``marker`` (by default all of
    ``head``; Mistral's is ``[TOOL_CALLS]`` of ``[TOOL_CALLS][``), or in the marker and
    the start of the rest of the call; with ``optional_head``, also when the reply starts
    with the call's JSON. The grammar applies from there on. A trigger never fires on
    text the grammar would refuse, so the grammar never meets a piece it cannot accept.
    """
    for name, _ in functions:
        if not name or not all(c.isalnum() or c in "_-" for c in name) or not name.isascii():
            raise InvalidArgument(f"a function name is letters, digits, _ and -, got {name!r}")
    if answer is not None and lazy:
        raise InvalidArgument("a grammar with an answer schema is not lazy")
    marker = head if marker is None else marker
    if not head.startswith(marker) or not marker:
        raise InvalidArgument(f"a call's marker {marker!r} starts its head {head!r}")
    canonical = json.dumps(
        [
            head,
            tail,
            [[n, json.loads(canonical_schema(s))] for n, s in functions],
            None if answer is None else json.loads(canonical_schema(answer)),
            key,
            marker,
            optional_head,
        ]
    )
    before = _functions_gbnf.cache_info().hits
    gbnf, triggers, elapsed = _functions_gbnf(canonical)
    cached = _functions_gbnf.cache_info().hits > before
    return Grammar(
        gbnf,
        triggers=triggers if lazy else (),
        compile_s=0.0 if cached else elapsed,
        cached=cached,
    )


def schema_cache_info() -> GrammarCacheInfo:
    return _CACHE.info()


def clear_schema_cache() -> None:
    """Forget every compiled schema (the benchmark's cold start)."""
    _CACHE.clear()
    _functions_gbnf.cache_clear()


# -- the sampler step ---------------------------------------------------------------------------


def init_grammar_sampler(lib: Any, vocab: Any, grammar: Grammar) -> Any:
    """llama.cpp's grammar sampler for ``grammar``; ``InvalidArgument`` if it does not parse."""
    text, root = grammar.gbnf.encode("utf-8"), grammar.root.encode("utf-8")
    if grammar.triggers:
        patterns = (ctypes.c_char_p * len(grammar.triggers))(
            *(p.encode("utf-8") for p in grammar.triggers)
        )
        sampler = lib.llama_sampler_init_grammar_lazy_patterns(
            vocab, text, root, patterns, len(grammar.triggers), None, 0
        )
    else:
        sampler = lib.llama_sampler_init_grammar(vocab, text, root)
    if not sampler:
        raise InvalidArgument("the grammar does not parse (llama.cpp refused it)")
    return sampler


def check_grammar(lib: Any, vocab: Any, grammar: Grammar) -> None:
    """Parse ``grammar`` against ``vocab`` and free it: raises ``InvalidArgument`` if bad."""
    lib.llama_sampler_free(init_grammar_sampler(lib, vocab, grammar))


class GrammarSampler:
    """One sequence's grammar beside its sampler chain (see the module docstring).

    ``sample`` picks the next token from the logits row and advances both the chain
    and the grammar. An end-of-generation token is never fed to the grammar: the
    sequence ends there, and llama.cpp aborts on an end token the grammar did not allow.
    """

    #: sample free first and check that token (False: the grammar over every token,
    #: every step; the benchmark's comparison)
    check_first = True

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, grammar: Grammar) -> None:
        import numpy as np

        self._lib = lib
        self._np = np
        self._vocab = vocab
        self._n = n_vocab
        self.sampler = init_grammar_sampler(lib, vocab, grammar)
        self._data = (lib.llama_token_data * n_vocab)()
        self._all = lib.llama_token_data_array(
            data=self._data, size=n_vocab, selected=-1, sorted=False
        )
        self._one_data = (lib.llama_token_data * 1)()
        self._one = lib.llama_token_data_array(
            data=self._one_data, size=1, selected=-1, sorted=False
        )
        dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self._view = np.frombuffer(self._data, dtype=dtype)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        #: tokens the grammar rejected after a free sample (each cost a full pass)
        self.resampled = 0
        #: an end token: an untriggered lazy grammar lets it through, a triggered one
        #: does not (a call follows its marker), which tells the two apart
        self._end = next(
            (
                t
                for t in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab))
                if t >= 0 and lib.llama_vocab_is_eog(vocab, t)
            ),
            None,
        )
        #: a lazy grammar not yet triggered: sampled as if there were none
        self.awaiting = bool(grammar.triggers) and self._awaits()

    def _fill(self, logits: Any) -> None:
        view = self._view
        view["id"] = self._ids
        view["logit"] = self._np.ctypeslib.as_array(logits, shape=(self._n,))
        view["p"] = 0.0
        self._all.size = self._n
        self._all.selected = -1
        self._all.sorted = False

    def _allowed(self, token: int) -> bool:
        one = self._one_data[0]
        one.id = token
        one.logit = 1.0
        one.p = 0.0
        self._one.size = 1
        self._one.selected = -1
        self._one.sorted = False
        self._lib.llama_sampler_apply(self.sampler, ctypes.byref(self._one))
        return not math.isinf(self._one_data[0].logit)

    def _selected(self) -> int:
        if self._all.selected < 0:  # pragma: no cover - a parsed grammar always allows one
            raise DecodeError("the grammar allows no next token")
        return int(self._data[self._all.selected].id)

    def _awaits(self) -> bool:
        """Whether the grammar still lets the end through: an untriggered lazy grammar
        does (it constrains nothing yet)."""
        return self._end is not None and self._allowed(self._end)

    def sample(self, chain: Any, ctx: Any, row: int) -> int:
        """The next token; raises ``DecodeError`` if the grammar allows none."""
        lib = self._lib
        if self.awaiting:
            # llama.cpp fills and samples the row itself (and accepts into the chain):
            # no vocabulary-sized array crosses into Python for a token any text allows.
            token = int(lib.llama_sampler_sample(chain, ctx, row))
            if lib.llama_vocab_is_eog(self._vocab, token):
                return token
            if self._allowed(token):  # always, unless the grammar is complete
                lib.llama_sampler_accept(self.sampler, token)  # where the trigger fires
                self.awaiting = self._awaits()
                return token
            # A grammar that lets the end through and refuses this token constrains
            # already (a trigger into a complete grammar): sample under it, once more.
            self.awaiting = False
            return self._constrained(chain, lib.llama_get_logits_ith(ctx, row), accepted=True)
        logits = lib.llama_get_logits_ith(ctx, row)
        self._fill(logits)
        lib.llama_sampler_apply(chain, ctypes.byref(self._all))
        token = self._selected()
        if not self.check_first or not self._allowed(token):
            return self._constrained(chain, logits, accepted=False)
        if not lib.llama_vocab_is_eog(self._vocab, token):
            lib.llama_sampler_accept(self.sampler, token)
        lib.llama_sampler_accept(chain, token)
        return token

    def _constrained(self, chain: Any, logits: Any, *, accepted: bool) -> int:
        """The token sampled under the grammar over the whole vocabulary; ``accepted``:
        the chain took a refused token already (it is not told of a second)."""
        lib = self._lib
        self.resampled += 1
        self._fill(logits)
        lib.llama_sampler_apply(self.sampler, ctypes.byref(self._all))
        lib.llama_sampler_apply(chain, ctypes.byref(self._all))
        token = self._selected()
        if not lib.llama_vocab_is_eog(self._vocab, token):
            lib.llama_sampler_accept(self.sampler, token)
        if not accepted:
            lib.llama_sampler_accept(chain, token)
        return token

    def free(self) -> None:
        if self.sampler is not None:
            self._lib.llama_sampler_free(self.sampler)
            self.sampler = None
