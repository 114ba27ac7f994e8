"""Claude Code's settings on ``/v1/messages`` with the real default model: each
``output_config.effort`` of its recorded request answered (the same answer at every
effort, and said so, on a model without a thinking phase), and its context edits
(``clear_tool_uses_20250919``) applied to the prompt for real."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import plainhttp

from ..conftest import NET, Served, SharedServer, collect, real_runtime, shared_server
from .test_anthropic import CLAUDE_CODE, SAMPLED_TOOLS, name

pytestmark = pytest.mark.model

CLEAR = "clear_tool_uses_20250919"


@pytest.fixture(scope="module")
def shared(module_home: Path) -> Iterator[SharedServer]:
    with shared_server(real_runtime) as server:
        yield server


def _claude_code(served: Served, **change: Any) -> dict[str, Any]:
    """The recorded request with two of its tools (its 25 outgrow the default context)."""
    body = json.loads(json.dumps(CLAUDE_CODE["body"]))
    body["tools"] = [t for t in body["tools"] if t["name"] in SAMPLED_TOOLS]
    body.update(model=name(served), max_tokens=6, temperature=0.0, **change)
    return body


def _stream(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    with plainhttp.stream(
        "POST",
        served.url + CLAUDE_CODE["path"],
        json=body,
        headers=CLAUDE_CODE["headers"],
        timeout=NET,
    ) as answer:
        assert answer.status_code == 200, answer.read()
        return collect([line for line in answer.iter_lines() if line])


def _text(events: list[dict[str, Any]]) -> str:
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    return "".join(d.get("text") or d.get("partial_json") or "" for d in deltas)


def test_every_effort_of_claude_code_is_answered_the_same(served: Served) -> None:
    answers = {}
    for effort in ("low", "medium", "high", "xhigh", "max"):
        events = _stream(served, _claude_code(served, output_config={"effort": effort}))
        delta = events[-2]
        assert delta["type"] == "message_delta"
        said = delta["tokenbelt"]["effort"]
        assert said["effort"] == effort
        assert said["applied"] is False
        assert "no thinking phase" in said["why"]
        assert "the same at every effort" in said["why"]
        # Claude Code sends clear_thinking_20251015: there is no thinking to clear.
        assert delta["context_management"] == {"applied_edits": []}
        answers[effort] = _text(events)
    assert len(set(answers.values())) == 1, answers


TOOLS = [
    {
        "name": name_,
        "description": f"{name_} a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name_ in ("Read", "Grep")
]


def _history(uses: int) -> list[dict[str, Any]]:
    """A conversation of ``uses`` tool uses, each with a long result, then a question."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look at the files."}]
    for i in range(uses):
        tool = "Grep" if i == 1 else "Read"
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": tool, "input": {"path": f"f{i}"}}
        result = " ".join(f"line {i}.{n} of the file f{i}." for n in range(16))
        messages += [
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": result}
                ],
            },
        ]
    return [*messages, {"role": "user", "content": [{"type": "text", "text": "Sum up."}]}]


def _count(served: Served, body: dict[str, Any]) -> int:
    keys = ("model", "messages", "tools", "context_management")
    r = plainhttp.post(
        f"{served.url}/v1/messages/count_tokens",
        json={k: body[k] for k in keys if k in body},
        timeout=NET,
    )
    assert r.status_code == 200, r.text
    count: int = r.json()["input_tokens"]
    return count


def test_clear_tool_uses_clears_the_old_results_from_the_prompt(served: Served) -> None:
    base = {"model": name(served), "max_tokens": 4, "messages": _history(4), "tools": TOOLS}
    edit: dict[str, Any] = {
        "type": CLEAR,
        "trigger": {"type": "tool_uses", "value": 2},
        "keep": {"type": "tool_uses", "value": 1},
        "exclude_tools": ["Grep"],
    }
    body = {**base, "context_management": {"edits": [edit]}}
    whole, edited = _count(served, base), _count(served, body)
    r = plainhttp.post(f"{served.url}/v1/messages", json=body, timeout=NET)
    assert r.status_code == 200, r.text
    [applied] = r.json()["context_management"]["applied_edits"]
    # four uses: the latest kept, Grep's excluded, the other two cleared
    assert applied == {
        "type": CLEAR,
        "cleared_tool_uses": 2,
        "cleared_input_tokens": whole - edited,
    }
    assert whole - edited > 150  # two results of 16 lines each
    trace = served.recorder.nth(0)
    assert trace.prompt_tokens == edited  # the prompt the model read is the edited one
    # With the inputs cleared too, the prompt is shorter still.
    inputs = {**edit, "clear_tool_inputs": True}
    assert _count(served, {**base, "context_management": {"edits": [inputs]}}) < edited


@pytest.mark.parametrize(
    "change",
    [
        {"trigger": {"type": "tool_uses", "value": 5}},  # four uses: not yet
        {},  # 100,000 input tokens by default: far off
        {"trigger": {"type": "tool_uses", "value": 1}, "keep": {"type": "tool_uses", "value": 4}},
        {
            "trigger": {"type": "input_tokens", "value": 100},
            "clear_at_least": {"type": "input_tokens", "value": 50_000},
        },
    ],
    ids=["trigger-uses", "trigger-default", "keep-all", "clear-at-least"],
)
def test_clear_tool_uses_that_does_not_trigger_leaves_the_prompt(
    served: Served, change: dict[str, Any]
) -> None:
    """Nothing cleared: the prompt counts the same as without the edit (the answer's
    ``applied_edits`` is then empty, as the effort test reads)."""
    base = {"model": name(served), "messages": _history(4), "tools": TOOLS}
    body = {**base, "context_management": {"edits": [{"type": CLEAR, **change}]}}
    assert _count(served, body) == _count(served, base)
