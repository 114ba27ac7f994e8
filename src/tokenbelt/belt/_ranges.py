"""The one range table: every count and duration a user may set, its bounds and why.

The SDK checks a value with ``check``; the command line's argparse types call the same
``check``; the HTTP schemas take their ``ge``/``le`` from ``bounds`` (so the OpenAPI
document states the same range). A value outside is refused where it comes in, before
it can reach a background thread, a timer or llama.cpp.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .._errors import InvalidArgument

#: the largest context (tokens per sequence) any surface accepts: 1Mi tokens, more than
#: any model is trained on; a reply, a belt or a prompt step never needs more
MAX_CONTEXT = 1 << 20
#: a year, in seconds: past it no ``threading`` timer can wait (``OverflowError``)
YEAR_S = 365 * 24 * 3600.0
#: 4x this machine's CPUs: llama.cpp's OpenMP runtime kills the process when it cannot
#: create the threads asked for
MAX_THREADS = 4 * (os.cpu_count() or 1)


@dataclass(frozen=True)
class Range:
    """The values one setting accepts: ``low`` to ``high`` (both included unless
    ``low_open``), integers unless ``integer`` is False (then finite numbers)."""

    low: float
    high: float
    #: what the number counts, as the error message and the OpenAPI description say it
    unit: str
    #: why these bounds (the reason a value past them would do harm)
    why: str
    integer: bool = True
    #: ``low`` itself is refused (a duration that must be more than 0)
    low_open: bool = False

    def text(self) -> str:
        """``an integer from 1 to 256 sequences`` or ``a number more than 0 and at most ...``."""
        kind = "an integer" if self.integer else "a number"
        low, high = _plain(self.low), _plain(self.high)
        unit = f" {self.unit}" if self.unit else ""
        days = f" ({self.high / 86400:.0f} days)" if self.unit == "seconds" else ""
        if self.low_open:
            return f"{kind} more than {low} and at most {high}{unit}{days}"
        return f"{kind} from {low} to {high}{unit}{days}"

    def contains(self, value: object) -> bool:
        """Whether ``value`` is of the right kind (``bool`` is not a number) and in range."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            return False
        above = self.low < value if self.low_open else self.low <= value
        return above and value <= self.high

    def bounds(self) -> dict[str, Any]:
        """The keyword arguments of a pydantic ``Field`` that states this range."""
        low_key = "gt" if self.low_open else "ge"
        if self.integer:
            return {low_key: int(self.low), "le": int(self.high)}
        return {low_key: self.low, "le": self.high}


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


_TOKENS_WHY = "no reply, belt or prompt outgrows the largest context (1Mi tokens)"

#: name -> its range, for every count and duration the SDK, the CLI and the HTTP API take
RANGES: MappingProxyType[str, Range] = MappingProxyType(
    {
        # -- the runtime and its models (SDK keywords, serve flags) ------------------------
        "capacity": Range(
            1,
            MAX_CONTEXT,
            "tokens",
            "a belt never needs room for more tokens than the longest reply; 0 would hold nothing",
        ),
        "slots": Range(
            1,
            256,
            "sequences",
            "llama.cpp's LLAMA_MAX_SEQ: a context with more sequences fails to load",
        ),
        "queue_size": Range(
            1,
            65536,
            "requests",
            "the admission queue is bounded (no unbounded queue on a token path); past this, a "
            "503 is kinder than the wait",
        ),
        "n_ctx": Range(
            64,
            MAX_CONTEXT,
            "tokens",
            "at least a chat template and a short turn; at most the largest context any model "
            "runs, so the KV cache llama.cpp sizes from it stays allocatable",
        ),
        "threads": Range(
            1,
            MAX_THREADS,
            "threads",
            "4x the CPUs here: llama.cpp's OpenMP runtime kills the process when it cannot create "
            "the threads",
        ),
        "prefill_chunk": Range(
            1,
            65536,
            "tokens",
            "prompt tokens per batched step; llama.cpp clamps it to its batch anyway, and the "
            "batch is an int32 count",
        ),
        "cache_tokens": Range(
            64,
            MAX_CONTEXT,
            "tokens",
            "the most prompt tokens a model's prefix cache keeps in memory (a longer prompt "
            "keeps its head); at least a chat template's head, at most the largest context",
        ),
        "cache_reuse": Range(
            0,
            MAX_CONTEXT,
            "tokens",
            "0 is off; the shortest chunk of a cached prompt whose cells are moved rather than "
            "computed again, and no chunk is longer than the largest context",
        ),
        "decode_nice": Range(
            0,
            19,
            "",
            "how much nicer than the rest of the process the decode threads run: 0 is the same "
            "priority, 19 the least a thread can have; a negative value would need privileges",
        ),
        "draft_tokens": Range(
            1,
            64,
            "tokens",
            "the longest prompt-lookup draft one sequence verifies in a step; the engine times "
            "steps up to this size, and a longer draft is rarely all accepted",
        ),
        "upstream_concurrency": Range(
            1,
            4096,
            "requests",
            "connections held open to one upstream at once; more exhausts file descriptors before "
            "it helps",
        ),
        # -- one request (SDK keywords, chat flags, every HTTP dialect) --------------------
        "max_tokens": Range(1, MAX_CONTEXT, "tokens", _TOKENS_WHY),
        "min_tokens": Range(0, MAX_CONTEXT, "tokens", _TOKENS_WHY),
        "n": Range(
            1,
            16,
            "choices",
            "each choice is a sequence of its own, taking a slot; 16 keeps one request from "
            "holding a whole server",
        ),
        "top_k": Range(
            0,
            100_000,
            "tokens",
            "0 is off; more candidates than this samples the same as off, at the cost of a sort "
            "per token",
        ),
        "repeat_last_n": Range(
            -1,
            MAX_CONTEXT,
            "tokens",
            "Ollama's: the last tokens the repeat penalty looks at; 0 is off, -1 the whole context",
        ),
        "top_logprobs": Range(
            0,
            20,
            "tokens",
            "OpenAI's limit; each one is a search of the vocabulary per generated token",
        ),
        "seed": Range(0, 2**32 - 1, "", "llama.cpp's sampler seed is a uint32"),
        "reasoning_budget": Range(0, MAX_CONTEXT, "tokens", _TOKENS_WHY),
        "num_ctx": Range(
            1,
            MAX_CONTEXT,
            "tokens",
            "Ollama's context size: a chat's window (a model's context is at most this)",
        ),
        "num_predict": Range(
            -2,
            MAX_CONTEXT,
            "tokens",
            "Ollama's: -1 and -2 run to the end of the context, 0 is refused; at most the largest "
            "context",
        ),
        # -- durations, in seconds ---------------------------------------------------------
        "keep_alive": Range(
            0,
            YEAR_S,
            "seconds",
            "0 unloads at once; past a year no timer can wait (threading raises OverflowError)",
            integer=False,
        ),
        "delay": Range(
            0,
            YEAR_S,
            "seconds",
            "a wait that may be none (0): a drain, a health-check interval; past a year no timer "
            "can wait",
            integer=False,
        ),
        "timeout": Range(
            0,
            YEAR_S,
            "seconds",
            "a deadline, a grace or a timeout; past a year no timer can wait and no date can be "
            "written",
            integer=False,
            low_open=True,
        ),
    }
)


def check(name: str, value: Any, *, param: str | None = None, label: str | None = None) -> Any:
    """Return ``value`` if it is in the range ``RANGES[name]`` states, else raise
    ``InvalidArgument`` naming it (``label``, default ``name``) and the range.

    A duration comes back as a float; ``bool`` is never a number.
    """
    limits = RANGES[name]
    what = label or name
    if not limits.contains(value):
        raise InvalidArgument(f"{what} must be {limits.text()}, got {value!r}", param=param or what)
    return value if limits.integer else float(value)
