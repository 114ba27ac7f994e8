"""litellm, a client no one here wrote, reads tokenbelt's ends without guessing.

litellm maps each ``finish_reason`` into OpenAI's set and logs "Unmapped finish_reason"
(then says ``stop``) for any other value: a deadline must reach it as an end it knows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tokenbelt import EndReason, ScriptedEngine

from ..conftest import NET, Served, ServeFactory, scripted_runtime, words

# The price list ships with litellm; without this it would fetch one from the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm: Any = pytest.importorskip("litellm")

# litellm's own types make pydantic warn as they are first used; that is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pydantic")


@pytest.fixture(autouse=True)
def _close_the_loop_litellm_leaves() -> Iterator[None]:
    """A blocking litellm call dispatches its service hooks on the main thread's event
    loop, which ``asyncio.get_event_loop()`` creates and litellm never closes. Closed
    here: left to the garbage collector, it fails whichever later test it is collected
    in (an unclosed-loop ``ResourceWarning`` is an error in this suite)."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop = asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:  # none was made
            return
    loop.close()
    asyncio.set_event_loop_policy(None)  # as before: no loop, none set


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
