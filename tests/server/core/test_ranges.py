"""Over HTTP, every count and duration keeps to the range table (``tokenbelt.belt.RANGES``).

Each dialect's OpenAPI schema states the table's range for the field, a value just
past either end is a 400 in that dialect's error shape naming the field and the range
(never a 500), and the server goes on serving. Parametrized from the table: an entry
must be placed in ``FIELDS`` or in ``NOT_HTTP``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import plainhttp
from tokenbelt import ScriptedEngine
from tokenbelt.belt import RANGES
from tokenbelt.server.anthropic._schemas import MessagesRequest
from tokenbelt.server.ollama._schemas import ChatRequest
from tokenbelt.server.openai._schemas import ChatCompletionRequest
from tokenbelt.server.responses._schemas import ResponseRequest

from ..conftest import NET, Served, SharedServer, scripted_runtime, shared_server, words

USER = [{"role": "user", "content": "hi"}]

#: dialect -> (route, a body it serves, its request model)
DIALECTS: dict[str, tuple[str, dict[str, Any], type[BaseModel]]] = {
    "openai": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}, ChatCompletionRequest),
    "ollama": (
        "/api/chat",
        {"model": "scripted", "messages": USER, "stream": False},
        ChatRequest,
    ),
    "anthropic": (
        "/v1/messages",
        {"model": "scripted", "messages": USER, "max_tokens": 2},
        MessagesRequest,
    ),
    "responses": (
        "/v1/responses",
        {"model": "scripted", "input": "hi", "max_output_tokens": 2},
        ResponseRequest,
    ),
}

_EXTENSION = ("openai", "ollama", "anthropic", "responses")

#: table entry -> the (dialect, field path) that take it
FIELDS: dict[str, list[tuple[str, str]]] = {
    "max_tokens": [
        ("openai", "max_tokens"),
        ("openai", "max_completion_tokens"),
        ("anthropic", "max_tokens"),
        ("responses", "max_output_tokens"),
    ],
    "min_tokens": [("openai", "min_tokens")],
    "n": [("openai", "n")],
    "top_k": [("openai", "top_k"), ("anthropic", "top_k"), ("ollama", "options.top_k")],
    "top_logprobs": [("openai", "top_logprobs"), ("ollama", "top_logprobs")],
    "seed": [("openai", "seed"), ("ollama", "options.seed"), ("responses", "seed")],
    "num_ctx": [("ollama", "options.num_ctx")],
    "repeat_last_n": [("ollama", "options.repeat_last_n")],
    "num_predict": [("ollama", "options.num_predict")],
    "capacity": [(d, "tokenbelt.capacity") for d in _EXTENSION],
    "reasoning_budget": [(d, "tokenbelt.reasoning_budget") for d in _EXTENSION],
    "timeout": [(d, "tokenbelt.total_timeout") for d in _EXTENSION]
    + [
        ("openai", "tokenbelt.first_token_timeout"),
        ("openai", "tokenbelt.stall_timeout"),
        ("openai", "tokenbelt.reasoning_timeout"),
    ],
}
#: entries no request body carries: the runtime's and the server's own settings; and
#: Ollama's ``keep_alive``, whose negative values mean "for ever" (its high end is
#: ``ollama/test_ollama.py``'s)
NOT_HTTP = {
    "slots",
    "queue_size",
    "n_ctx",
    "threads",
    "prefill_chunk",
    "cache_tokens",
    "cache_reuse",
    "decode_nice",
    "draft_tokens",
    "upstream_concurrency",
    "delay",
    "keep_alive",
}

CASES = [
    pytest.param(name, dialect, path, id=f"{name}-{dialect}-{path}")
    for name, places in sorted(FIELDS.items())
    for dialect, path in places
]


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    def make() -> Any:
        return scripted_runtime(ScriptedEngine(words(3), delay=0))

    with shared_server(make) as server:
        yield server


def _past(name: str) -> list[float]:
    limits = RANGES[name]
    step = 1 if limits.integer else 0.5
    low = limits.low if limits.low_open else limits.low - step
    return [low, limits.high + step]


def _with(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = {**body}
    *parents, leaf = path.split(".")
    node = body
    for part in parents:
        node[part] = {**node.get(part, {})}
        node = node[part]
    node[leaf] = value
    return body


def _message(dialect: str, body: Any) -> str:
    if dialect == "ollama":
        return str(body["error"])
    return str(body["error"]["message"])


def _schema_of(model: type[BaseModel], path: str) -> dict[str, Any]:
    """The JSON schema of the field at ``path``, its ``$ref``s and null branches resolved."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        for option in node.get("anyOf", [node]):
            if "$ref" in option:
                return resolve(defs[option["$ref"].rsplit("/", 1)[-1]])
            if option.get("type") != "null":
                return option
        return node

    node: dict[str, Any] = schema
    for part in path.split("."):
        node = resolve(node["properties"][part])
    return node


def test_every_entry_is_placed() -> None:
    assert set(FIELDS) | NOT_HTTP == set(RANGES)
    assert not set(FIELDS) & NOT_HTTP


@pytest.mark.parametrize(("name", "dialect", "path"), CASES)
def test_the_schema_states_the_tables_range(name: str, dialect: str, path: str) -> None:
    limits = RANGES[name]
    field = _schema_of(DIALECTS[dialect][2], path)
    low_key = "exclusiveMinimum" if limits.low_open else "minimum"
    assert (field[low_key], field["maximum"]) == (limits.low, limits.high)
    assert limits.text() in field.get("description", limits.text())


@pytest.mark.parametrize(("name", "dialect", "path"), CASES)
def test_just_past_either_end_is_a_400_naming_field_and_range(
    served: Served, name: str, dialect: str, path: str
) -> None:
    route, body, _ = DIALECTS[dialect]
    leaf = path.rsplit(".", 1)[-1]
    for value in _past(name):
        refused = plainhttp.post(f"{served.url}{route}", json=_with(body, path, value), timeout=NET)
        assert refused.status_code == 400, refused.text
        message = _message(dialect, refused.json())
        assert f"{leaf}: must be {RANGES[name].text()}, got {value!r}" in message
    assert served.recorder.events == []  # refused before anything was queued
    again = plainhttp.post(f"{served.url}{route}", json=body, timeout=NET)
    assert again.status_code == 200, again.text
