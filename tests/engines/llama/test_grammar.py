"""Grammars: schema compilation (cached; refused when neither the grammar nor validation
can enforce it), the sampler step (a lazy grammar's free text sampled plain) and the
batch engine's constrained sampling on the real model."""

from __future__ import annotations

import ctypes
import json
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tokenbelt import EndReason, InvalidArgument, Runtime, ScriptedEngine
from tokenbelt.belt import Belt, Trace
from tokenbelt.engines import (
    BatchEngine,
    GenerationRequest,
    Grammar,
    GrammarSampler,
    SamplingParams,
    check_enforceable,
    clear_schema_cache,
    functions_grammar,
    json_object_grammar,
    schema_cache_info,
    schema_grammar,
)
from tokenbelt.engines.llama import _native
from tokenbelt.models import default_model_path
from tokenbelt.runtime import structured
from tooling import WEATHER, trigger_fires, trigger_matches

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 12}},
    "required": ["x", "label"],
}


# -- compilation ----------------------------------------------------------------------------------


def test_a_schema_compiles_once_and_is_then_cached() -> None:
    clear_schema_cache()
    cold = schema_grammar(POINT)
    warm = schema_grammar(json.dumps(POINT))  # its JSON text is the same schema
    assert not cold.cached
    assert cold.compile_s > 0
    assert warm.cached
    assert warm.compile_s == 0.0
    assert warm == cold
    info = schema_cache_info()
    assert (info.hits, info.misses, info.size) == (1, 1, 1)
    assert info.compile_s >= cold.compile_s


def test_strings_hold_only_what_json_allows_unescaped() -> None:
    # The converter's own rules let a raw newline (or, through a pattern's ".", a raw
    # quote) into a string: the reply would not parse.
    text = schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}}).gbnf
    char = next(line for line in text.splitlines() if line.startswith("char ::="))
    assert char.startswith('char ::= [^"\\\\\\x00-\\x1F\\x7F] |')
    text = schema_grammar({"type": "string", "pattern": "^a.b$"}).gbnf
    assert 'dot ::= [^"\\\\\\x00-\\x1F\\x7F]' in text


def test_property_order_is_the_output_order() -> None:
    reordered = {**POINT, "properties": dict(reversed(list(POINT["properties"].items())))}
    a, b = schema_grammar(POINT).gbnf, schema_grammar(reordered).gbnf
    assert a != b
    root = next(line for line in a.splitlines() if line.startswith("root ::="))
    assert root.index("x-kv") < root.index("label-kv")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strange"}, "cannot be compiled"),
        ({"type": "string", "pattern": "(("}, "cannot be compiled"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be an object"),
        # neither the grammar nor validation after the reply can do these
        ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
        ({"properties": {"a": {"type": "integer", "minimum": 3, "maximum": 2}}}, "properties.a"),
        ({"anyOf": [{"type": "string", "format": "colour"}]}, r"anyOf\[0\]"),
    ],
)
def test_what_cannot_be_enforced_is_refused(schema: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        schema_grammar(schema)


def test_a_property_named_like_a_keyword_is_fine() -> None:
    check_enforceable({"type": "object", "properties": {"maximum": {"type": "integer"}}})


def test_a_function_grammar_and_its_trigger() -> None:
    functions = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
    eager = functions_grammar(functions, head="<tool_call>", tail="</tool_call>", lazy=False)
    lazy = functions_grammar(functions, head="<tool_call>", tail="</tool_call>", lazy=True)
    assert eager.triggers == ()
    assert eager.gbnf == lazy.gbnf
    assert len(lazy.triggers) == 1
    # Fires on the opening tag and any start of the call's JSON, never on what the
    # grammar would refuse (which llama.cpp could not feed to it), also after long text.
    prose = "The weather is a fine thing to ask about. " * 30
    for fires in ("<tool_call>", 'hi <tool_call>\n{"na', 'x<tool_call>{"name": "'):
        assert trigger_fires(lazy, fires)
        assert trigger_fires(lazy, prose + fires)
    for waits in ("<tool_ca", prose, prose + "<tool_c"):
        assert not trigger_fires(lazy, waits)
    for refused in ("<tool_call> hello", '<tool_call>{"nombre', "hi <tool_call>!"):
        assert not trigger_matches(lazy.triggers[0], refused)  # as one token's piece
    same_name = [
        (f, {"$defs": {"Addr": {"type": t}}, "properties": {"a": {"$ref": "#/$defs/Addr"}}})
        for f, t in (("f", "string"), ("g", "integer"))
    ]
    with pytest.raises(InvalidArgument, match="define 'Addr' differently"):
        functions_grammar(same_name, head="<", tail=">", lazy=False)
    with pytest.raises(InvalidArgument, match="function name"):
        functions_grammar([("no spaces", {})], head="<", tail=">", lazy=False)


def test_a_request_with_a_grammar_pickles() -> None:
    request = GenerationRequest.chat(
        [{"role": "user", "content": "hi"}], grammar=schema_grammar(POINT)
    )
    again = pickle.loads(pickle.dumps(request))
    assert again == request
    assert again.grammar is not None
    assert again.grammar.gbnf == request.grammar.gbnf  # type: ignore[union-attr]


def test_an_engine_without_grammars_refuses_one() -> None:
    with Runtime(keep_alive=None) as runtime:
        runtime.add_engines("scripted", [ScriptedEngine(["a"])])
        request = GenerationRequest.chat(
            [{"role": "user", "content": "hi"}], grammar=json_object_grammar()
        )
        with pytest.raises(InvalidArgument, match="grammar"):
            runtime.get("scripted").submit(request)


# -- the sampler step, on the real vocabulary and llama.cpp's grammar ------------------------------


class ScriptedLogits:
    """llama.cpp's binding with one logits row that favours the next token of a script,
    counting the sampler calls: a sampler step's seam. ``llama_sampler_sample`` does what
    llama.cpp's does (the row into an array, the chain over it, the chain told)."""

    def __init__(self, n_vocab: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self._n = n_vocab
        self.row = (ctypes.c_float * n_vocab)()
        self.plain = 0  # llama_sampler_sample calls
        self.full = 0  # sampler applies over more than one token

    def favour(self, token: int) -> None:
        ctypes.memset(self.row, 0, ctypes.sizeof(self.row))
        self.row[token] = 10.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def llama_get_logits_ith(self, ctx: object, row: int) -> Any:
        return self.row

    def llama_sampler_apply(self, sampler: object, array: Any) -> None:
        self.full += array._obj.size > 1
        self._lib.llama_sampler_apply(sampler, array)

    def llama_sampler_sample(self, chain: object, ctx: object, row: int) -> int:
        self.plain += 1
        lib = self._lib
        data = (lib.llama_token_data * self._n)(*((t, self.row[t], 0.0) for t in range(self._n)))
        array = lib.llama_token_data_array(data=data, size=self._n, selected=-1, sorted=False)
        lib.llama_sampler_apply(chain, ctypes.byref(array))
        token = int(data[array.selected].id)
        lib.llama_sampler_accept(chain, token)
        return token


def test_free_text_under_a_lazy_grammar_is_sampled_plain_and_the_call_constrained() -> None:
    tools = structured.tools_from([WEATHER])
    grammar = structured.tools_grammar(tools, "auto")
    assert grammar is not None
    assert grammar.triggers
    call = structured.ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    prose, rest = "Let me look that up. ", structured.render_call(call) + " Hello"
    model = _native.load_vocab(default_model_path())
    lib = ScriptedLogits(model.n_vocab())
    sampler = GrammarSampler(lib, model.vocab, model.n_vocab(), grammar)
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
    try:
        out = []
        for text in (prose, rest):
            for token in model.tokenize(text.encode(), False, False):
                lib.favour(token)
                out.append(sampler.sample(chain, None, 0))
                if lib.llama_vocab_is_eog(model.vocab, out[-1]):
                    break
            if text is prose:  # no trigger yet: each token the plain sample, no array
                assert (lib.plain, lib.full) == (len(out), 0)
                assert sampler.awaiting
        # The call went through as written; the prose after it is refused: only the end.
        assert lib.llama_vocab_is_eog(model.vocab, out[-1])
        assert sampler.resampled == 1
        assert not sampler.awaiting
        reply = model.detokenize(out[:-1], False).decode()
        before, calls = structured.parse_tool_calls(reply, tools)
        assert (before, [(c.name, c.arguments) for c in calls]) == (
            prose,
            [(call.name, call.arguments)],
        )
    finally:
        lib.llama_sampler_free(chain)
        sampler.free()
        model.close()


# -- constrained sampling on the real model -----------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchEngine]:
    e = BatchEngine(default_model_path(), slots=2, n_ctx=1024, cache_entries=0)
    try:
        yield e
    finally:
        e.close()


def run(engine: BatchEngine, request: GenerationRequest) -> tuple[str, EndReason]:
    """Run one request through the engine's blocking path and read it all."""
    belt: Belt[str] = Belt(64, trace=Trace("req_test"))
    engine.count_prompt_tokens(request)
    pieces: list[str] = []

    def produce() -> EndReason:
        return belt.produce(lambda p: engine.generate(request, p))  # type: ignore[arg-type]

    thread = threading.Thread(target=produce)
    thread.start()
    pieces.extend(belt)
    thread.join(30)
    assert belt.end_reason is not None
    return "".join(pieces), belt.end_reason


@pytest.mark.model
@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_constrained_replies_match_their_schema(engine: BatchEngine, temperature: float) -> None:
    grammar = schema_grammar(POINT)
    for seed in range(3):
        request = GenerationRequest.chat(
            [{"role": "user", "content": "Write a poem about the sea."}],
            SamplingParams(max_tokens=100, temperature=temperature, seed=seed),
            grammar=grammar,
        )
        text, reason = run(engine, request)
        assert reason is EndReason.STOP
        jsonschema.validate(json.loads(text), POINT)


@pytest.mark.model
def test_a_grammar_that_does_not_parse_is_refused_before_it_queues(engine: BatchEngine) -> None:
    request = GenerationRequest.chat(
        [{"role": "user", "content": "hi"}], grammar=Grammar('root ::= "a" undefined-rule')
    )
    with pytest.raises(InvalidArgument, match="does not parse"):
        engine.count_prompt_tokens(request)


TREE_DEFS = {
    "Tree": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 8},
            "children": {"type": "array", "items": {"$ref": "#/$defs/Tree"}, "maxItems": 2},
        },
        "required": ["label", "children"],
    }
}
#: shapes pydantic and langchain write: a bare ``list`` (``items: {}``), ``items: true``,
#: bounds with no ``items``, a recursive model (its root only a ``$ref`` into ``$defs``)
WRITTEN_BY_CLIENTS = [
    {
        "type": "object",
        "properties": {"c": {"type": "array", "items": {}, "maxItems": 3}},
        "required": ["c"],
    },
    {
        "type": "object",
        "properties": {"c": {"type": "array", "items": True, "maxItems": 3}},
        "required": ["c"],
    },
    {"type": "object", "properties": {"c": {"type": "array", "maxItems": 1}}, "required": ["c"]},
]


def test_a_recursive_model_compiles_from_its_root_ref() -> None:
    grammar = schema_grammar({"$defs": TREE_DEFS, "$ref": "#/$defs/Tree"})
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines() if " ::= " in line)
    assert "label-kv" in rules["root"]
    assert "children-kv" in rules["root"]
    assert "Tree" in rules["children-item"]  # the recursion, through $defs


def test_a_schema_of_only_validated_keywords_is_any_value_checked_after() -> None:
    from tokenbelt.engines.llama._schema_rules import audit

    for schema in ({"not": {"type": "string"}}, {"uniqueItems": True, "description": "d"}):
        grammar = schema_grammar(schema)  # the converter alone refused it
        lines = grammar.gbnf.splitlines()
        rules = dict(line.split(" ::= ", 1) for line in lines if " ::= " in line)
        assert rules["root"].strip() == "value"
        assert audit(schema).checked_after  # what the grammar lets through is validated


@pytest.mark.model
@pytest.mark.parametrize("schema", WRITTEN_BY_CLIENTS, ids=["empty", "true", "bounds"])
def test_schemas_clients_write_compile_and_hold(engine: BatchEngine, schema: Any) -> None:
    request = GenerationRequest.chat(
        [{"role": "user", "content": "Give me the numbers 1, 2 and 3 as JSON."}],
        SamplingParams(max_tokens=120, temperature=0.0),
        grammar=schema_grammar(schema),
    )
    text, reason = run(engine, request)
    assert reason is EndReason.STOP, text
    jsonschema.validate(json.loads(text), schema)
