"""Shared fixtures: every test must leave no thread or task behind."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from fimmodel import fim_model
from templates import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, THINKING_TEMPLATE, with_template
from tokenbelt.belt import invariants
from tokenbelt.models import default_model_path

# Every trace event of every test is checked against the timeline's invariants.
invariants.enable()

# Tests send SIGINT to the commands they start, as a terminal's Ctrl-C would. A suite
# started in the background by a shell without job control inherits SIGINT ignored, and
# would hand that to every child (``models pull`` would then never see the signal).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _pin_this_worker() -> None:
    """Under pytest-xdist, give each worker its own share of the cores (CPU affinity, which
    the processes it starts inherit): every model a test loads then sees a machine of that
    many cores and sizes its threads to it, rather than two workers' llama.cpp thread
    teams spinning against each other on the same cores."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker[2:]) % count :: count])


_pin_this_worker()

# Threads owned by long-lived machinery outside any one test.
_IGNORED_THREAD_PREFIXES = (
    "asyncio_",
    "ThreadPoolExecutor",
    "pytest_timeout",
    "tokenbelt-release-watch",  # one per process, like asyncio's own threads
    "litellm-logging",  # litellm's process-wide logging pool (tests/server/openai/test_litellm.py)
)


@pytest.fixture(autouse=True)
def timeline_invariants() -> Iterator[None]:
    """Fail a test during which any request broke a timeline invariant."""
    invariants.clear()
    yield
    broken = invariants.clear()
    if broken:
        pytest.fail("timeline invariants broken:\n" + "\n".join(broken))


def _shared(thread: threading.Thread) -> bool:
    """A worker thread of the event loop of a server shared by a module's tests.

    AnyIO starts such threads on demand and they live as long as that loop, which
    outlives every single test (``SharedServer`` in tests/server/conftest.py marks it).
    """
    return bool(getattr(getattr(thread, "loop", None), "shared_by_module", False))


def _foreign_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in before
        and t.is_alive()
        and not t.name.startswith(_IGNORED_THREAD_PREFIXES)
        and not _shared(t)
    ]


@pytest.fixture(autouse=True)
def tokenbelt_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test (and every process it starts) gets its own empty tokenbelt home."""
    home = tmp_path_factory.mktemp("tokenbelt-home")
    monkeypatch.setenv("TOKENBELT_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread running (after a short grace period)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    leaked = _foreign_threads(before)
    while leaked and time.monotonic() < deadline:
        leaked[0].join(0.05)
        leaked = _foreign_threads(before)
    if leaked:
        pytest.fail(f"test left threads running: {[t.name for t in leaked]}")


def _is_test_runner_task(task: asyncio.Task[object]) -> bool:
    """True for the task anyio's pytest plugin starts to hand a fixture step to its runner.

    It is created after the fixture's snapshot and is still waiting while the fixture
    tears down, but it belongs to the test machinery, not to the code under test.
    """
    return getattr(task.get_coro(), "__qualname__", "").startswith("TestRunner.")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail an async test that leaves a task running."""
    before = asyncio.all_tasks()
    yield
    for _ in range(50):
        leaked = {
            t
            for t in asyncio.all_tasks() - before - {asyncio.current_task()}
            if not _is_test_runner_task(t)
        }
        if not leaked:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"test left tasks running: {leaked}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("anyio") is not None and isinstance(item, pytest.Function):
            item.fixturenames.append("no_leaked_tasks")


#: a small Hermes-style chat template that renders ``tools`` into the system turn
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

Function signatures are within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

Return each call within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="session")
def fim_gguf() -> Path:
    """The embedded model with FIM tokens declared (``fimmodel.fim_model``, cached)."""
    return fim_model()


@pytest.fixture(scope="session")
def tool_template_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model with ``TOOLS_TEMPLATE`` as its chat template (a GGUF copy)."""
    path = tmp_path_factory.mktemp("gguf") / "smollm2-tools.gguf"
    with_template(Path(default_model_path()), path, TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model with a Qwen3-style thinking template (``THINKING_TEMPLATE``):
    its generation prompt opens ``<think>``, so every chat reply starts reasoning."""
    path = tmp_path_factory.mktemp("gguf") / "smollm2-thinking.gguf"
    with_template(Path(default_model_path()), path, THINKING_TEMPLATE)
    return path


#: a test GGUF per tool-call family: the embedded model with that family's template
NATIVE_TEMPLATES = {
    "hermes": TOOLS_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
}


@pytest.fixture(scope="session")
def native_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``native_model(family)``: the embedded model with that family's chat template
    (``NATIVE_TEMPLATES``), a GGUF copy written on first use and kept for the session."""
    folder = tmp_path_factory.mktemp("native-gguf")

    def path(family: str) -> Path:
        target = folder / f"smollm2-{family}.gguf"
        if not target.exists():
            with_template(Path(default_model_path()), target, NATIVE_TEMPLATES[family])
        return target

    return path
