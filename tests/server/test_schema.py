"""Schemathesis over the app's own OpenAPI schema, against the live server: no 5xx, and
every answer as the document says (its status listed, its content type and body schema).

Both valid and invalid inputs are generated for every operation (a bounded number of
examples each), against a scripted model with a short script so each call is quick.
The one 5xx the API answers on purpose is a 504 for a deadline the request itself set
(a generated ``first_token_timeout`` of a microsecond, say); any other is a failure. The
Ollama and Anthropic routes are in the schema too, each with its own error shape: the
exact end reason of a 504 is in the ``tokenbelt`` object every one of them carries.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import plainhttp
from tokenbelt import EndReason, ScriptedEngine

from .conftest import NET, ServeFactory, scripted_runtime, words

MAX_EXAMPLES = 25
TIMEOUTS = {r.value for r in EndReason if r.is_timeout}
VALID = {
    "/v1/chat/completions": {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "scripted", "prompt": "hi", "max_tokens": 4},
}


def check_answer(case: Any) -> int:
    response = case.call(timeout=NET)
    status: int = response.status_code
    checks = [content_type_conformance, response_schema_conformance]
    # FastAPI's own 422 for a bad field becomes a 400 with the validation change on
    # its way (every request error a 400); until then a 422 is the one status unlisted.
    if status != 422:
        checks.append(status_code_conformance)
    if status == 504:
        assert response.json()["tokenbelt"]["end_reason"] in TIMEOUTS, response.text
    else:
        checks.append(not_a_server_error)
    case.validate_response(response, checks=checks)
    assert response.headers.get("x-request-id"), (case.method, case.path, status)
    return status


def test_no_5xx_over_the_openapi_schema(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0), queue_size=64))
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {(op.method.upper(), op.path) for op in operations}
    assert ("POST", "/v1/chat/completions") in paths
    assert ("POST", "/v1/requests/{request_id}/cancel") in paths
    assert ("POST", "/api/chat") in paths
    assert ("POST", "/v1/messages") in paths

    # Valid and invalid inputs for every operation, MAX_EXAMPLES per operation in all.
    strategy = st.one_of(
        [op.as_strategy(generation_mode=mode) for op in operations for mode in GenerationMode]
    )
    seen: dict[tuple[str, str], set[int]] = {}

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES * len(operations),
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        status = check_answer(case)
        seen.setdefault((case.method.upper(), case.path), set()).add(status)

    run()
    # A guard on the run itself: generated requests were refused (4xx) on the two routes
    # that run the model, and a valid body through the same checks reached it (200). The
    # 200 is a hand-made body, not a generated one: most bodies the schema allows are
    # still refused (an assistant turn with neither content nor tool calls, a list prompt
    # of two strings), so a generated 200 is a matter of chance.
    operation = {(op.method.upper(), op.path): op for op in operations}
    for path, body in VALID.items():
        statuses = seen[("POST", path)]
        assert any(400 <= s < 500 for s in statuses), (path, statuses)
        case = operation[("POST", path)].Case(body=body, media_type="application/json")
        assert check_answer(case) == 200, path
    stats = served.model().statistics()
    assert (stats.running, stats.queued) == (0, 0)


def test_the_document_lists_every_status_and_error_body(serve: ServeFactory) -> None:
    served = serve(scripted_runtime(ScriptedEngine(words(3), delay=0)))
    document = plainhttp.get(f"{served.url}/openapi.json", timeout=NET).json()
    paths = document["paths"]

    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "421", "429", "500", "502", "503", "504"} <= set(chat)
    assert "422" not in chat
    error = chat["429"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/OpenAIError"}
    assert "text/event-stream" in chat["200"]["content"]
    ollama = paths["/api/chat"]["post"]["responses"]
    assert ollama["400"]["content"]["application/json"]["schema"]["$ref"].endswith("OllamaError")
    assert "application/x-ndjson" in ollama["200"]["content"]
    messages = paths["/v1/messages"]["post"]["responses"]
    assert messages["504"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "AnthropicError"
    )
    assert set(paths["/v1/requests/{request_id}/cancel"]["post"]["responses"]) >= {"404", "401"}
    for operations in paths.values():
        for operation in operations.values():
            assert "421" in operation["responses"]
            assert "422" not in operation["responses"]

    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    served_metrics = plainhttp.get(f"{served.url}/metrics", timeout=NET)
    assert served_metrics.headers["content-type"].startswith("text/plain")
