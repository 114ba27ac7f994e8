"""Shared pieces of the command line: a parser whose errors are one line, value types."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .._defaults import DEFAULT_DECODE_NICE, DEFAULT_PREFILL_GAP
from .._errors import InvalidArgument
from ..belt import check, check_capacity, check_duration, check_keep_alive

if TYPE_CHECKING:
    from ..engines import LlamaConfig
    from ..runtime import Model, Runtime

T = TypeVar("T")


#: the environment variables every command reads, shown at the end of every ``--help``
ENVIRONMENT = """\
environment:
  TOKENBELT_HOME     where models, the user catalog and stamps live
                     (default: the XDG data and cache folders, ~/.local/share/tokenbelt)
  TOKENBELT_API_KEY  the default for --api-key (serve; chat --url)
  HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE
                     the Hugging Face cache, hub address and offline mode (hf:// models)"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (unless its help already says it), keeps the epilog's lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
            or action.nargs == 0
        ):
            return text
        shown = f"{default:g}" if isinstance(default, float) else default
        return f"{text} (default {shown})".strip()


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reports a bad flag in one line and exits with 2.

    Every parser's help lists the defaults and the environment variables.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", ENVIRONMENT)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if "the following arguments are required: COMMAND" in message or (
            "the following arguments are required: ACTION" in message
        ):
            # A bare ``tokenbelt`` (or ``tokenbelt models``): what can be done, not a riddle.
            self.print_help(sys.stderr)
            self.exit(2, f"\n{self.prog}: error: choose a command\n")
        self.exit(2, f"{self.prog}: error: {message}\n")


def _convert(text: str, parse: Callable[[str], T]) -> T:
    try:
        return parse(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _non_negative(value: int) -> int:
    if value < 0:
        raise InvalidArgument(f"value must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (capacities, slots, limits)."""
    return _convert(text, lambda t: check_capacity(int(t), name="value"))


def counted(name: str) -> Callable[[str], int]:
    """An argparse type for the count ``name`` of the range table (``RANGES``): the
    SDK's own check, so a flag accepts exactly what the SDK and the HTTP API accept."""

    def convert(text: str) -> int:
        return _convert(text, lambda t: int(check(name, int(t))))

    convert.__name__ = name  # argparse names the type in its "invalid ..." message
    return convert


def n_ctx(text: str) -> int:
    """A context size per sequence: the SDK's own bounds (``Runtime(n_ctx=...)``)."""
    from ..runtime import check_n_ctx

    return _convert(text, lambda t: check_n_ctx(int(t)))


def non_negative_int(text: str) -> int:
    return _convert(text, lambda t: _non_negative(int(t)))


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tb": 1000**4,
    "tib": 1024**4,
}


def _bytes(text: str) -> int:
    number = text.strip().lower().rstrip("bikmgt")
    unit = text.strip().lower()[len(number) :]
    what = (
        "a size is a number of bytes with an optional unit (kB, MB, GB, TB, KiB, MiB, "
        f"GiB, TiB: 64MiB, 500kB), got {text!r}"
    )
    if unit not in _UNITS or not number:
        raise InvalidArgument(what)
    try:
        value = float(number)
    except ValueError:
        raise InvalidArgument(what) from None
    return _non_negative(int(value * _UNITS[unit]))


def byte_size(text: str) -> int:
    """A size in bytes >= 0, with an optional unit: ``64MiB``, ``500kB``, ``1GB``."""
    return _convert(text, _bytes)


def duration(text: str) -> float:
    """A finite number >= 0 (seconds or milliseconds, as the flag says)."""
    return _convert(text, lambda t: check_duration("value", float(t)) or 0.0)


def keep_alive_seconds(text: str) -> float:
    """A ``keep_alive`` in seconds, in the range the SDK and the HTTP API accept."""
    return _convert(text, lambda t: check_keep_alive(float(t)) or 0.0)


def positive_duration(text: str) -> float:
    """A duration in seconds, in the range of ``RANGES["timeout"]``: more than 0, at most a
    year (the SDK's ``Limits`` and the HTTP API's timeouts)."""
    return _convert(text, lambda t: float(check("timeout", float(t), label="value")))


def sampling_value(name: str, kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type for the sampling parameter ``name``: the SDK's own check, so
    the command line accepts exactly what the SDK and the HTTP API accept."""
    from ..engines import SamplingParams

    def parse(text: str) -> Any:
        value = kind(text)
        given: dict[str, Any] = {name: value}
        SamplingParams(**given)
        return value

    def convert(text: str) -> Any:
        return _convert(text, parse)

    convert.__name__ = name  # argparse names the type in its "invalid ..." message
    return convert


def fail(message: str, status: int = 1) -> NoReturn:
    """Print a one-line error to stderr and exit."""
    print(f"tokenbelt: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def thread_count(text: str) -> int:
    """A llama.cpp thread count: an integer from 1 to 4x this machine's CPUs."""
    from ..engines import check_threads

    return _convert(text, lambda t: check_threads("value", int(t)) or 1)


def add_isolation_options(
    p: argparse.ArgumentParser, *, grace: bool = True, default: str = "thread"
) -> None:
    """``--isolation`` (and ``--stop-grace``), shared by the commands that load a model."""
    where = {"thread": "in this process", "process": "in a worker process"}[default]
    p.add_argument(
        "--isolation",
        choices=("thread", "process"),
        default=default,
        help=f"where the model runs (default {default}: {where}); process: in a worker "
        "process, whose native crash ends the running requests instead of the program, and "
        "which restarts; thread: in this process",
    )
    if grace:
        p.add_argument(
            "--stop-grace",
            type=positive_duration,
            default=3.0,
            metavar="S",
            help="with --isolation process: seconds a stop may take before the worker is "
            "killed (default 3)",
        )


def add_thread_options(p: argparse.ArgumentParser) -> None:
    """``--threads``, ``--threads-batch``, ``--decode-nice``, ``--prefill-chunk`` and
    ``--prefill-gap``, shared by the commands that load a model."""
    p.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="llama.cpp decode threads (default: every core this process may use)",
    )
    p.add_argument(
        "--threads-batch",
        type=thread_count,
        default=None,
        help="llama.cpp prompt threads (default: every core this process may use)",
    )
    p.add_argument(
        "--decode-nice",
        type=counted("decode_nice"),
        default=DEFAULT_DECODE_NICE,
        metavar="N",
        help="how much nicer than the server's own threads llama.cpp's decode threads run, "
        "0 to 19, Linux only: the thread that sends a token gets a core at once "
        f"(default {DEFAULT_DECODE_NICE}; 0: the same priority)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=counted("prefill_chunk"),
        default=128,
        help="fewest prompt tokens per batched step while others decode, more as "
        "--prefill-gap allows (default 128)",
    )
    p.add_argument(
        "--prefill-gap",
        type=duration,
        default=DEFAULT_PREFILL_GAP,
        metavar="SECONDS",
        help="how long one batched step's prompt tokens may take while others decode, by "
        f"the engine's own timing (default {DEFAULT_PREFILL_GAP:g}; 0: exactly --prefill-chunk)",
    )


def missing_model_file(alias: str) -> str | None:
    """The path ``alias`` names if it looks like a file path that does not exist, else None.

    A name ending in ``.gguf`` or holding a path separator is a file, never a catalog
    alias: so "file not found", not "unknown model".
    """
    path = Path(alias).expanduser()
    looks_like_path = alias.endswith(".gguf") or "/" in alias or os.sep in alias
    if looks_like_path and not path.is_file():
        from ..models import is_speech_model

        return None if is_speech_model(str(path)) else str(path)
    return None


def _memory_parts(info: dict[str, Any], context: int, engine: LlamaConfig) -> list[str]:
    """What the context and the prefix cache cost, as the load estimated them: the KV
    cache (how a long agent prompt and several short requests share it) and the prefix
    cache's tokens and bytes."""
    need = info.get("memory_estimate") or {}
    parts = []
    if need.get("kv"):
        trained = info.get("context_length")
        why = " (the model's trained length)" if trained == context else ""
        parts.append(f"KV cache {need['kv'] / 2**20:.0f} MiB{why}")
    if need.get("cache") and info.get("cache_tokens"):
        parts.append(
            f"prefix cache up to {info['cache_tokens']} tokens "
            f"({need['cache'] / 2**20:.0f} MiB in memory"
            + (
                f", kept in {engine.prefix_cache_dir})"
                if engine.prefix_cache_dir and engine.prefix_cache_disk
                else ")"
            )
        )
    return parts


def startup_line(model: Model, runtime: Runtime, url: str | None = None) -> str:
    """One line saying what runs where: device, threads, context, slots, file (and URL).

    Reads ``model.info`` where the engine fills it in, with the runtime's settings as
    fallbacks, so it prints what is known and nothing made up.
    """
    info = model.info
    device = info.get("device") or ("cpu" if not info.get("n_gpu_layers") else "gpu")
    threads = info.get("threads") or runtime.engine.n_threads or "auto"
    threads_batch = info.get("threads_batch") or runtime.engine.n_threads_batch
    threads_text = f"{threads} threads" + (
        f" ({threads_batch} for prompts)" if threads_batch and threads_batch != threads else ""
    )
    if info.get("decode_nice"):
        threads_text += f" at nice +{info['decode_nice']}"
    context = info.get("n_ctx_per_seq") or model.context_length or runtime.n_ctx
    slots = info.get("slots") or model.statistics().slots or runtime.slots
    parts = [
        f"{model.name} on {device}",
        threads_text,
        # a speech model has no context window: it reads 30 s windows of audio
        "30 s audio windows"
        if info.get("kind") == "speech"
        else f"context {context} tokens per sequence",
        f"{slots} slot{'s' if slots != 1 else ''}",
        *_memory_parts(info, context, runtime.engine),
        f"file {info.get('path') or 'unknown'}",
    ]
    if info.get("isolation") == "process":
        from ..engines import WorkerEngine

        engine = model.engines[0] if model.engines else None
        pid = engine.pid if isinstance(engine, WorkerEngine) else None
        parts.insert(1, f"in worker process {pid}" if pid else "in a worker process")
    if url is not None:
        parts.append(url)
    return ", ".join(parts)
