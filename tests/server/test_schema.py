"""Schemathesis over the app's own OpenAPI schema, against the live server: no 5xx.

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

from tokenbelt import EndReason, ScriptedEngine

from .conftest import NET, ServeFactory, scripted_runtime, words

MAX_EXAMPLES = 25
TIMEOUTS = {r.value for r in EndReason if r.is_timeout}


def check_no_server_error(case: Any) -> int:
    response = case.call(timeout=NET)
    status: int = response.status_code
    if status < 500:
        return status
    if status == 504 and response.json()["tokenbelt"]["end_reason"] in TIMEOUTS:
        return status
    raise AssertionError(
        f"{case.method} {case.formatted_path} -> {status}\n"
        f"body sent: {case.body!r}\nanswer: {response.text[:500]}"
    )


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
        status = check_no_server_error(case)
        seen.setdefault((case.method.upper(), case.path), set()).add(status)

    run()
    # A guard on the run itself: generated requests did reach the model, and were refused.
    for path in ("/v1/chat/completions", "/v1/completions"):
        statuses = seen[("POST", path)]
        assert 200 in statuses, (path, statuses)
        assert any(400 <= s < 500 for s in statuses), (path, statuses)
    stats = served.model().statistics()
    assert (stats.running, stats.queued) == (0, 0)
