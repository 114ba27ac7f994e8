"""litellm, a client no one here wrote, reads tokenbelt's ends without guessing.

litellm maps each ``finish_reason`` into OpenAI's set and logs "Unmapped finish_reason"
(then says ``stop``) for any other value: a deadline must reach it as an end it knows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tokenbelt import EndReason, ScriptedEngine

from .conftest import NET, Served, ServeFactory, scripted_runtime, words

# The price list ships with litellm; without this it would fetch one from the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm: Any = pytest.importorskip("litellm")

# litellm's own types make pydantic warn as they are first used; that is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pydantic")


@pytest.fixture
def served(serve: ServeFactory) -> Served:
    return serve(scripted_runtime(ScriptedEngine(words(100_000), delay=0.002), name="endless"))


@pytest.fixture
def warnings_of_litellm() -> Iterator[list[str]]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("LiteLLM")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def test_a_deadline_end_is_a_finish_reason_litellm_knows(
    served: Served, warnings_of_litellm: list[str]
) -> None:
    chunks = litellm.completion(
        model="openai/endless",
        api_base=f"{served.url}/v1",
        api_key="x",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        timeout=NET,
        extra_body={"tokenbelt": {"total_timeout": 0.3}},
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]  # cut short by a limit: the answer is incomplete
    assert not [w for w in warnings_of_litellm if "finish_reason" in w], warnings_of_litellm
    trace = served.recorder.nth(0)
    served.assert_released(trace, EndReason.TOTAL_TIMEOUT)
