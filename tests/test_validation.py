"""One set of rules for the SDK, the command line and the HTTP API.

A sampling value, a context size or a message shape that one surface refuses, the
others refuse too, each with one clear line; and what one accepts, the others accept.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tokenbelt import InvalidArgument, PromptTooLong, Runtime, SamplingParams, ScriptedEngine
from tokenbelt.cli import build_parser
from tokenbelt.engines import SAMPLING_RANGES, GenerationRequest
from tokenbelt.models import default_model_path
from tokenbelt.runtime._runtime import MIN_N_CTX
from tokenbelt.server.openai._schemas import ChatCompletionRequest

NET_S = 60.0
WORDS = [" w0", " w1", " w2"]

#: (parameter, a value every surface refuses, the highest value every surface accepts)
OUT_OF_RANGE: list[tuple[str, float, float]] = [
    ("temperature", 5.0, 2.0),
    ("temperature", -0.1, 2.0),
    ("top_p", 0.0, 1.0),
    ("top_p", 1.5, 1.0),
    ("min_p", 1.5, 1.0),
    ("repeat_penalty", 11.0, 10.0),
    ("top_k", 100_001, 100_000),
    ("seed", 2**32, 2**32 - 1),
    ("max_tokens", 0, 1_000_000),
]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenbelt", *args],
        capture_output=True,
        text=True,
        timeout=NET_S,
        check=False,
        env={**os.environ, "COLUMNS": "100"},
    )


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- sampling ranges ------------------------------------------------------------------------


def _bounds(schema: dict[str, Any]) -> tuple[float | None, float | None, bool]:
    """(lowest, highest, lowest included) of one field of a pydantic JSON schema."""
    for option in schema.get("anyOf", [schema]):
        if "minimum" in option or "exclusiveMinimum" in option or "maximum" in option:
            if "exclusiveMinimum" in option:
                return option["exclusiveMinimum"], option.get("maximum"), False
            return option.get("minimum"), option.get("maximum"), True
    return None, None, True


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_the_http_schema_has_the_sdk_ranges(name: str) -> None:
    fields = ChatCompletionRequest.model_json_schema()["properties"]
    assert _bounds(fields[name]) == SAMPLING_RANGES[name]


@pytest.mark.parametrize(("name", "bad", "good"), OUT_OF_RANGE, ids=lambda v: str(v))
def test_the_sdk_refuses_what_http_refuses(name: str, bad: float, good: float) -> None:
    with pytest.raises(InvalidArgument, match=name):
        SamplingParams(**{name: bad})
    assert getattr(SamplingParams(**{name: good}), name) == good


def test_temperature_5_is_refused_by_the_sdk_before_anything_runs() -> None:
    with Runtime(keep_alive=None) as rt:
        engine = ScriptedEngine(WORDS, delay=0)
        model = rt.add_engines("scripted", [engine])
        with pytest.raises(InvalidArgument, match=r"temperature must be in \[0, 2\], got 5"):
            model.stream("hi", temperature=5)
        with pytest.raises(InvalidArgument, match="temperature"):
            model.chat(temperature=5)
        assert engine.tokens_computed == 0
        assert model.complete("hi", temperature=2).text == " w0 w1 w2"


@pytest.mark.parametrize(
    ("flag", "bad", "good"),
    [("--temperature", "5", "2"), ("--max-tokens", "0", "1000000"), ("--seed", "-1", "7")],
)
def test_the_cli_refuses_and_accepts_the_same_values(flag: str, bad: str, good: str) -> None:
    done = _cli("chat", flag, bad)
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert f"argument {flag}: " in line
    assert flag.strip("-").replace("-", "_") + " must be" in line
    parsed = build_parser().parse_args(["chat", flag, good])
    assert str(getattr(parsed, flag.strip("-").replace("-", "_"))) in (good, f"{good}.0")


# -- the context size -----------------------------------------------------------------------


def test_an_n_ctx_too_small_for_a_prompt_is_refused_by_sdk_and_cli() -> None:
    with pytest.raises(InvalidArgument, match=f"n_ctx must be an integer from {MIN_N_CTX} to"):
        Runtime(n_ctx=10)
    done = _cli("serve", "--n-ctx", "10")
    assert done.returncode == 2
    assert f"n_ctx must be an integer from {MIN_N_CTX} to" in _one_line(done.stderr)


def test_an_n_ctx_past_the_trained_context_is_refused_unless_forced() -> None:
    done = _cli("serve", "--n-ctx", "100000", "--port", "0")
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert "trained on (8192 tokens)" in line
    assert "--force-n-ctx" in line


@pytest.mark.model
def test_the_sdk_loads_within_the_trained_context_and_past_it_only_when_forced() -> None:
    with Runtime(keep_alive=None, n_ctx=100_000, slots=1) as rt:
        with pytest.raises(InvalidArgument, match=r"trained on \(8192 tokens\)"):
            rt.load(str(default_model_path()))
        assert rt.models == {}
    with Runtime(keep_alive=None, n_ctx=8200, slots=1, force_n_ctx=True, prefix_cache=False) as rt:
        model = rt.load(str(default_model_path()))
        assert model.context_length == 8200


@pytest.mark.model
def test_the_smallest_n_ctx_serves_a_short_turn_and_refuses_a_long_prompt() -> None:
    with Runtime(keep_alive=None, n_ctx=MIN_N_CTX, slots=1) as rt:
        model = rt.load(str(default_model_path()))
        reply = model.complete("hi", max_tokens=4, temperature=0)
        assert reply.text
        with pytest.raises(PromptTooLong, match=f"holds {MIN_N_CTX}"):
            model.complete("hello " * 100, max_tokens=4)


# -- message shapes and the trace of a finished turn ----------------------------------------


def test_model_stream_of_a_string_is_one_user_message() -> None:
    with Runtime(keep_alive=None) as rt:
        model = rt.add_engines("scripted", [ScriptedEngine(WORDS, delay=0)])
        assert "".join(model.stream("Write a haiku")) == " w0 w1 w2"
        assert model.complete("Write a haiku").text == " w0 w1 w2"


def test_a_string_where_messages_belong_says_to_pass_messages() -> None:
    with pytest.raises(InvalidArgument, match=r"pass \[\{'role': 'user', 'content': text\}\]"):
        GenerationRequest(messages="Write a haiku")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ({"prompt": "hi", "prompt_tokens": (1, 2)}, "either messages, a prompt or"),
        ({}, "either messages, a prompt or"),
        ({"prompt_tokens": ()}, "non-empty tuple"),
        ({"prompt_tokens": [1, 2]}, "non-empty tuple"),
        ({"prompt_tokens": (1, -2)}, "integers >= 0"),
        ({"prompt_tokens": (1, True)}, "integers >= 0"),
        ({"prompt_tokens": (1, "2")}, "integers >= 0"),
        ({"prompt": "hi", "continue_final": True}, "must end with one"),
        ({"messages": ({"role": "user", "content": "hi"},), "continue_final": True}, "end with"),
        ({"messages": ({"role": "assistant", "content": " "},), "continue_final": True}, "end"),
    ],
)
def test_a_prompt_of_token_ids_is_one_tuple_of_ids_alone(given: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        GenerationRequest(**given)
    request = GenerationRequest(prompt_tokens=(1, 2, 3))
    assert (request.prompt, request.messages, request.prompt_tokens) == (None, None, (1, 2, 3))


@pytest.mark.model
def test_the_trace_of_a_finished_send_holds_its_release() -> None:
    with Runtime(keep_alive=None, n_ctx=512, slots=1) as rt:
        model = rt.load(str(default_model_path()))
        with model.chat() as chat:
            reply = chat.send("hi", max_tokens=4, temperature=0)
        trace = reply.trace.to_dict()
        assert trace["timeline_ms"]["released"] is not None
        assert trace["end_to_end_ms"] is not None


# -- keep_alive ------------------------------------------------------------------------------


def test_a_keep_alive_past_a_year_is_refused_by_sdk_and_cli_naming_the_range() -> None:
    with pytest.raises(InvalidArgument, match=r"keep_alive must be a number from 0 to 31536000"):
        Runtime(keep_alive=1e15)
    done = _cli("serve", "--keep-alive", "1e15")
    assert done.returncode == 2
    assert "argument --keep-alive: keep_alive must be a number from 0 to 31536000" in _one_line(
        done.stderr
    )
    assert build_parser().parse_args(["serve", "--keep-alive", "31536000"]).keep_alive == 31536000
