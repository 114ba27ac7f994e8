"""Every count and duration has one stated range, and the SDK and the CLI keep to it.

Parametrized from the range table (``tokenbelt.belt.RANGES``): a new entry is tested
here without a line more, and one no SDK call or flag takes must say so (``SDK`` and
``FLAGS`` below). The HTTP side is ``tests/server/core/test_ranges.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tokenbelt import InvalidArgument, Limits, Runtime, SamplingParams, ScriptedEngine
from tokenbelt._defaults import DEFAULT_PREFILL_GAP
from tokenbelt.belt import RANGES, check
from tokenbelt.belt._ranges import YEAR_S
from tokenbelt.cli import build_parser
from tokenbelt.engines.remote import Upstream

NET_S = 60.0


def past(name: str) -> list[float]:
    """The values just past each end of ``name``'s range."""
    limits = RANGES[name]
    step = 1 if limits.integer else 0.5
    low = limits.low if limits.low_open else limits.low - step
    return [low, limits.high + step]


def ends(name: str) -> list[float]:
    """The ends themselves, where accepted (an open low end is not: its next value is)."""
    limits = RANGES[name]
    low = limits.low + 0.5 if limits.low_open else limits.low
    return [int(low) if limits.integer else low, limits.high]


def _runtime(**options: Any) -> None:
    with Runtime(**options):
        pass


def _sampling(name: str) -> Callable[[Any], object]:
    def make(value: Any) -> object:
        given: dict[str, Any] = {name: value}
        if name == "top_logprobs":
            given["logprobs"] = True
        if name == "min_tokens":
            given["max_tokens"] = RANGES["max_tokens"].high
        return SamplingParams(**given)

    return make


#: table entry -> the SDK call that takes it (None: no SDK call does; HTTP only)
SDK: dict[str, Callable[[Any], object] | None] = {
    "capacity": lambda v: _runtime(capacity=v),
    "slots": lambda v: _runtime(slots=v),
    "queue_size": lambda v: _runtime(queue_size=v),
    "n_ctx": lambda v: _runtime(n_ctx=v),
    "threads": lambda v: _runtime(n_threads=v),
    "prefill_chunk": lambda v: _runtime(prefill_chunk=v),
    "draft_tokens": lambda v: _runtime(draft_tokens=v),
    "cache_tokens": lambda v: _runtime(cache_tokens=v),
    "cache_reuse": lambda v: _runtime(cache_reuse=v),
    "decode_nice": lambda v: _runtime(decode_nice=v),
    "upstream_concurrency": lambda v: Upstream("http://127.0.0.1:9", "m", max_concurrency=v),
    "max_tokens": _sampling("max_tokens"),
    "min_tokens": _sampling("min_tokens"),
    "top_k": _sampling("top_k"),
    "top_logprobs": _sampling("top_logprobs"),
    "repeat_last_n": _sampling("repeat_last_n"),
    "seed": _sampling("seed"),
    "reasoning_budget": _sampling("reasoning_budget"),
    "keep_alive": lambda v: _runtime(keep_alive=v),
    "timeout": lambda v: Limits(total=v),
    "delay": lambda v: ScriptedEngine(["x"], delay=v),
    "n": None,  # the OpenAI dialect's choices
    "num_ctx": None,  # Ollama's options
    "num_predict": None,
}

#: table entry -> (command, flag) that takes it (None: no flag does)
FLAGS: dict[str, tuple[str, str] | None] = {
    "capacity": ("serve", "--capacity"),
    "slots": ("serve", "--slots"),
    "queue_size": ("serve", "--queue-size"),
    "n_ctx": ("serve", "--n-ctx"),
    "threads": ("serve", "--threads"),
    "prefill_chunk": ("serve", "--prefill-chunk"),
    "cache_tokens": ("serve", "--cache-tokens"),
    "cache_reuse": ("serve", "--cache-reuse"),
    "decode_nice": ("serve", "--decode-nice"),
    "upstream_concurrency": ("serve", "--upstream-concurrency"),
    "max_tokens": ("chat", "--max-tokens"),
    "seed": ("chat", "--seed"),
    "keep_alive": ("serve", "--keep-alive"),
    "timeout": ("serve", "--first-token-timeout"),
    "delay": ("serve", "--upstream-health-interval"),
    "min_tokens": None,
    "draft_tokens": None,
    "top_k": None,
    "top_logprobs": None,
    "repeat_last_n": None,
    "reasoning_budget": None,
    "n": None,
    "num_ctx": None,
    "num_predict": None,
}


def test_every_entry_states_a_reason_and_is_placed_on_each_surface() -> None:
    for name, limits in RANGES.items():
        assert limits.low < limits.high, name
        assert len(limits.why) > 20, name
    assert set(SDK) == set(RANGES)
    assert set(FLAGS) == set(RANGES)


@pytest.mark.parametrize("name", sorted(RANGES))
def test_the_check_accepts_the_ends_and_refuses_just_past_them(name: str) -> None:
    text = RANGES[name].text()
    for value in ends(name):
        assert check(name, value) == value
    for value in past(name):
        with pytest.raises(InvalidArgument) as refused:
            check(name, value)
        assert str(refused.value) == f"{name} must be {text}, got {value!r}"
        assert refused.value.param == name
    for wrong in (True, "1", None, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match=f"{name} must be"):
            check(name, wrong)
    if RANGES[name].integer:
        with pytest.raises(InvalidArgument, match=f"{name} must be an integer"):
            check(name, float(ends(name)[0]))


@pytest.mark.parametrize("name", sorted(n for n, call in SDK.items() if call is not None))
def test_the_sdk_accepts_the_ends_and_refuses_just_past_them(name: str) -> None:
    call = SDK[name]
    assert call is not None
    for value in ends(name):
        call(value)
    for value in past(name):
        with pytest.raises(InvalidArgument, match=re.escape(f"must be {RANGES[name].text()}")):
            call(value)


def _flag_value(name: str, value: float) -> str:
    return str(int(value)) if RANGES[name].integer else repr(float(value))


@pytest.mark.parametrize("name", sorted(n for n, flag in FLAGS.items() if flag is not None))
def test_the_cli_refuses_just_past_each_end_in_one_line_naming_flag_and_range(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    where = FLAGS[name]
    assert where is not None
    command, flag = where
    for value in past(name):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([command, flag, _flag_value(name, value)])
        assert done.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"tokenbelt {command}: error: argument {flag}: ")
        assert f"must be {RANGES[name].text()}" in lines[0]
    for value in ends(name):
        parsed = build_parser().parse_args([command, flag, _flag_value(name, value)])
        assert parsed is not None


def test_a_flag_past_its_range_exits_2_with_one_line_and_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tokenbelt", "serve", "--slots", "257"],
        capture_output=True,
        text=True,
        timeout=NET_S,
        check=False,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "tokenbelt serve: error: argument --slots: slots must be an integer from 1 to 256 "
        "sequences, got 257"
    ]


def test_the_prefill_gap_takes_a_delay_from_the_sdk_and_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for bad in ("-1", "nan", "1e12", "soon"):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(["serve", "--prefill-gap", bad])
        assert done.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("tokenbelt serve: error: argument --prefill-gap: "), lines
    assert build_parser().parse_args(["serve", "--prefill-gap", "0"]).prefill_gap == 0.0
    assert build_parser().parse_args(["serve"]).prefill_gap == DEFAULT_PREFILL_GAP
    for value in (-0.5, float("nan"), YEAR_S * 2):
        with pytest.raises(InvalidArgument, match="prefill_gap must be a number from 0"):
            _runtime(prefill_gap=value)
    with Runtime(prefill_gap=0) as runtime:
        assert runtime.engine.prefill_gap == 0.0
