"""What Codex sends to ``/v1/responses``, taken as Codex means it, over a scripted engine:
its recorded request (built-in and ``namespace`` tools), its follow-ups that answer a
call by the function's name rather than its ``call_id``, and the words of a refusal.
A real ``codex exec`` turn is in ``test_codex_cli.py``."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenbelt import EndReason, GenerationRequest, InvalidArgument
from tokenbelt.belt import Producer
from tokenbelt.server import ServerSettings
from tokenbelt.server.core import UnsupportedParameter

from ..conftest import ServeFactory
from .test_responses import Recording, _post, _runtime

#: the body Codex CLI 0.171.0 sent for ``codex exec "say hi"`` to a custom provider
CODEX = Path(__file__).parent.parent / "fixtures" / "codex_request.json"


class Ungrammared(Recording):
    """A scripted engine that writes what a tools grammar would let it write (the
    grammar is the real model's, tested with it): Codex's tools make one."""

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return super().count_prompt_tokens(dataclasses.replace(request, grammar=None))

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        return super().generate(dataclasses.replace(request, grammar=None), producer)


def _codex_body() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(CODEX.read_text())
    body.update(model="scripted", stream=False)
    return body


def test_codex_s_request_is_planned_and_its_built_in_tools_named(serve: ServeFactory) -> None:
    from tokenbelt.server.responses._routes import _plan
    from tokenbelt.server.responses._schemas import ResponseRequest
    from tokenbelt.server.responses._tools import offered

    body = ResponseRequest.model_validate(json.loads(CODEX.read_text()))
    assert body.store is False
    assert body.prompt_cache_key
    assert body.tools is not None
    model = serve(_runtime()).model("scripted")
    messages = [{"role": "user", "content": "say hi"}]
    # By default: the built-in tool left out and named; the namespace's functions offered.
    tools = offered(body.tools, "skip", ())
    assert tools.skipped == ["web_search"]
    plan = _plan(body, messages, model, tools)
    names = [t.name for t in plan.tools]
    assert names[:2] == ["exec_command", "write_stdin"]
    assert {"create_goal", "close_agent", "resume_agent", "send_input"} <= set(names)
    assert tools.namespaces["close_agent"] == "multi_agent_v1"
    assert "create_goal" not in tools.namespaces
    assert plan.choice == "auto"
    # Refused, when the server is told to: by name, with the flag that leaves it out.
    with pytest.raises(UnsupportedParameter, match="'web_search'") as refused:
        offered(body.tools, "refuse", ())
    assert refused.value.param == "tools.8.type"
    assert "--responses-skip-tool web_search" in str(refused.value)
    assert offered(body.tools, "refuse", ("web_search",)).skipped == ["web_search"]


def test_skipped_tool_types_are_named_in_the_response(
    serve: ServeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(_runtime())
    tools = [{"type": "web_search"}, {"type": "image_generation"}, {"type": "web_search"}]
    with caplog.at_level(logging.INFO, logger="tokenbelt.server"):
        r = _post(served, {"model": "scripted", "input": "hi", "tools": tools})
    assert r.status_code == 200, r.text
    assert r.json()["tokenbelt"]["skipped_tools"] == ["web_search", "image_generation"]
    said = [rec.getMessage() for rec in caplog.records if "built-in tools" in rec.getMessage()]
    assert said == [
        f"{r.headers['x-request-id']}: built-in tools left out (a local server "
        "cannot run them): web_search, image_generation"
    ]
    assert (
        _post(served, {"model": "scripted", "input": "hi"}).json()["tokenbelt"].get("skipped_tools")
        is None
    )


def test_built_in_tools_are_refused_when_the_server_says_so(serve: ServeFactory) -> None:
    served = serve(_runtime(), ServerSettings(responses_builtin_tools="refuse"))
    r = _post(served, {"model": "scripted", "input": "hi", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools.0.type"
    assert "--responses-builtin-tools refuse" in r.json()["error"]["message"]
    assert served.recorder.enqueued() == []


GOAL_CALL = {
    "type": "function_call",
    "call_id": "call_goal_1",
    "name": "create_goal",
    "arguments": json.dumps({"objective": "say hi"}),
}


@pytest.mark.parametrize("namespace", [None, "goals"], ids=["namespace-null", "namespace"])
def test_codex_s_create_goal_follow_up_is_answered(
    serve: ServeFactory, namespace: str | None
) -> None:
    """Codex answers its own ``create_goal`` call with an output that names the function
    (and a namespace) and has no ``call_id``: the output answers that call."""
    engine = Ungrammared(["Goal", " set."], delay=0, context_length=16384)
    served = serve(_runtime(engine))
    body = _codex_body()
    output = {
        "type": "function_call_output",
        "name": "create_goal",
        "namespace": namespace,
        "output": json.dumps({"goal": {"objective": "say hi", "status": "active"}}),
    }
    body["input"] = [*body["input"], GOAL_CALL, output]
    r = _post(served, body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed"
    assert r.json()["tokenbelt"]["skipped_tools"] == ["web_search"]
    *_, call, result = engine.seen[-1]
    # The call and its result, in the model's own tool format, one after the other.
    assert call["role"] == "assistant"
    assert '"name": "create_goal"' in call["content"]
    assert "<tool_response>" in result["content"]
    assert '"status": "active"' in result["content"]


def test_an_output_by_name_answers_the_latest_unanswered_call() -> None:
    from tokenbelt.server.responses._items import match_outputs

    def call(call_id: str, name: str = "create_goal", **more: str) -> dict[str, Any]:
        return {**GOAL_CALL, "call_id": call_id, "name": name, **more}

    def output(**by: str) -> dict[str, Any]:
        return {"type": "function_call_output", "output": "x", **by}

    items = [
        call("call_a"),
        output(call_id="call_a"),
        call("call_b"),
        call("call_c", "close_agent", namespace="multi_agent_v1"),
        call("call_d", "close_agent", namespace="other"),
        output(name="create_goal"),
        output(name="close_agent", namespace="multi_agent_v1"),
        output(name="close_agent"),
    ]
    match_outputs(items)
    answered = [item["call_id"] for item in items if item["type"] == "function_call_output"]
    assert answered == ["call_a", "call_b", "call_c", "call_d"]
    with pytest.raises(InvalidArgument, match="'create_goal'") as refused:
        match_outputs([call("call_a"), output(call_id="call_a"), output(name="create_goal")])
    assert refused.value.param == "input.2.name"
    with pytest.raises(UnsupportedParameter) as refused:
        match_outputs([output()], first=0)
    assert refused.value.param == "input.0.call_id"


def test_a_namespace_s_function_is_called_with_its_namespace(serve: ServeFactory) -> None:
    call = '<tool_call>{"name": "close_agent", "arguments": {"target": "a1"}}</tool_call>'
    served = serve(_runtime(Ungrammared([call], delay=0, context_length=16384)))
    body = _codex_body()
    body["tool_choice"] = "required"
    r = _post(served, body)
    assert r.status_code == 200, r.text
    [item] = r.json()["output"]
    assert item["type"] == "function_call"
    assert (item["name"], item["namespace"]) == ("close_agent", "multi_agent_v1")
    assert json.loads(item["arguments"]) == {"target": "a1"}
    # Sent back as Codex does, with its namespace, and answered by name: taken.
    follow = _codex_body()
    sent = {k: item[k] for k in ("type", "call_id", "name", "namespace", "arguments")}
    answer = {
        "type": "function_call_output",
        "name": "close_agent",
        "namespace": "multi_agent_v1",
        "output": "closed",
    }
    follow["input"] = [*follow["input"], sent, answer]
    assert _post(served, follow).status_code == 200


def test_a_refusal_names_the_real_problem_not_a_union_branch(serve: ServeFactory) -> None:
    """A bad item inside the ``input`` list is named; pydantic's complaint about the
    other branch (``input`` as a string) is not what the user reads."""
    bad = {"model": "scripted", "input": [{"type": "function_call", "name": "f", "arguments": 1}]}
    r = _post(serve(_runtime()), bad)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "arguments" in message
    assert "valid string" in message  # about arguments, which is a string
    assert not message.endswith("input: Input should be a valid string")
    assert "input: Input should be a valid string" not in message


def test_namespace_tools_that_do_not_fit_are_left_out_and_named(serve: ServeFactory) -> None:
    """Codex's sub-agent tools are a third of its prompt: when the prompt does not fit
    the context with them, the namespace is left out, named, and the request goes on."""

    def input_tokens(context: int, body: dict[str, Any]) -> httpx.Response:
        engine = Ungrammared(["ok"], delay=0, context_length=context)
        return _post(serve(_runtime(engine)), body)

    body = _codex_body()
    whole = input_tokens(16384, body).json()
    assert "skipped_namespaces" not in whole["tokenbelt"]
    alone = {**body, "tools": [t for t in body["tools"] if t["type"] != "namespace"]}
    less = input_tokens(16384, alone).json()["usage"]["input_tokens"]
    assert less < whole["usage"]["input_tokens"]
    between = (less + whole["usage"]["input_tokens"]) // 2
    r = input_tokens(between, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["input_tokens"] == less
    assert answer["tokenbelt"]["skipped_namespaces"] == ["multi_agent_v1"]
    assert answer["tokenbelt"]["skipped_tools"] == ["web_search", "namespace"]
    # A prompt too long even without them is the usual 400.
    assert input_tokens(less - 10, body).status_code == 400


def test_the_serve_flags_set_what_built_in_tools_get() -> None:
    from tokenbelt.cli import build_parser
    from tokenbelt.cli._serve import _settings

    default = _settings(build_parser().parse_args(["serve"]), [])
    assert (default.responses_builtin_tools, default.responses_skip_tools) == ("skip", ())
    flags = ["--responses-builtin-tools", "refuse", "--responses-skip-tool", "web_search"]
    refusing = _settings(build_parser().parse_args(["serve", *flags]), [])
    assert refusing.responses_builtin_tools == "refuse"
    assert refusing.responses_skip_tools == ("web_search",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--responses-builtin-tools", "sometimes"])
