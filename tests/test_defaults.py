"""One default reply length for every surface, the SDK included."""

from __future__ import annotations

from tokenbelt import EndReason, Runtime, ScriptedEngine
from tokenbelt._defaults import DEFAULT_MAX_TOKENS


def test_an_sdk_reply_without_max_tokens_stops_at_the_shared_default() -> None:
    with Runtime(keep_alive=None) as rt:
        model = rt.add_engines(
            "long", [ScriptedEngine([" w"] * (DEFAULT_MAX_TOKENS + 50), delay=0)]
        )
        reply = model.complete(prompt="go")
    assert reply.end_reason is EndReason.LENGTH
    assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS
