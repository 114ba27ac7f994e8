"""The flags of ``tokenbelt serve``: what is served, where it listens, the bounds of each
request, the prefix cache, and who may call it (``_serve.py`` acts on them)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .._defaults import (
    DEFAULT_CACHE_MEMORY,
    DEFAULT_CACHE_REUSE,
    DEFAULT_CAPACITY,
    DEFAULT_QUEUE_SIZE,
    SERVE_SLOTS,
    SERVE_TOTAL_TIMEOUT_S,
)
from ..engines import DEFAULT_PREFIX_CACHE_DISK, DRAFT_MODES, FLASH_ATTN, KV_TYPES
from ..runtime import DEFAULT_ALIAS, DEFAULT_SHARE
from ._common import (
    byte_size,
    counted,
    duration,
    keep_alive_seconds,
    n_ctx,
    non_negative_int,
    positive_duration,
)
from ._served import model_settings


def _port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def add_model_options(p: argparse.ArgumentParser) -> None:
    """What is served: a model, or the models of upstream servers."""
    p.add_argument(
        "alias",
        nargs="*",
        help=f"model aliases or .gguf paths: the first loads at start, the others on their "
        f"first request (default {DEFAULT_ALIAS}; none with --upstream)",
    )
    p.add_argument(
        "--all-models",
        action="store_true",
        help="also serve every catalog model whose file is on this machine, each loaded on "
        "its first request (default: only the aliases named)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="ALIAS",
        help="keep ALIAS loaded: never unloaded to make room for another model nor for "
        "being idle, and a request's keep_alive 0 for it is refused (repeatable; default: none)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        type=model_settings,
        metavar="SPEC",
        help="one model's own settings, SPEC being ALIAS:KEY=VALUE[,KEY=VALUE...] with keys "
        "slots, n_ctx, keep_alive (seconds; 0 = never unload), e.g. --model "
        "qwen3:slots=2,n_ctx=8192 (repeatable; default: the flags above, for every model)",
    )
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        metavar="SIZE",
        help="memory every loaded model may take together, in bytes or with a unit (8GiB, "
        "1500MB) (weights, KV cache, prefix cache, worker; tokenbelt ps shows each model's): "
        "a load that would pass it unloads idle models, least recently "
        f"used first; one that cannot fit is refused (default {DEFAULT_SHARE:.0%}% of the "
        "memory available at start; 0 = no budget)",
    )
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="serve every model this OpenAI-compatible server lists (vLLM, llama.cpp's "
        "server, Ollama, tokenbelt); repeat it to route between several (default: none, "
        "the local model only)",
    )
    p.add_argument(
        "--upstream-api-key-env",
        metavar="VAR",
        help="environment variable holding the upstreams' API key (default: none sent)",
    )
    p.add_argument(
        "--upstream-concurrency",
        type=counted("upstream_concurrency"),
        default=4,
        help="requests each upstream may hold at once (default 4)",
    )
    p.add_argument(
        "--upstream-health-interval",
        type=duration,
        default=5.0,
        metavar="S",
        help="seconds between health checks of each upstream (default 5; 0 = none)",
    )


def add_serving_options(p: argparse.ArgumentParser) -> None:
    """Where it listens, and the bounds of each request (the runtime's to apply)."""
    _add_listen_options(p)
    _add_deadline_options(p)
    _add_context_options(p)
    _add_cache_options(p)


def _add_listen_options(p: argparse.ArgumentParser) -> None:
    """Where it listens, and how many requests it holds: decoded together, and queued."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 = any free)")
    p.add_argument(
        "--capacity",
        type=counted("capacity"),
        default=DEFAULT_CAPACITY,
        help="belt capacity: tokens generation may run ahead of each reader",
    )
    p.add_argument(
        "--slots",
        type=counted("slots"),
        default=SERVE_SLOTS,
        help=f"requests decoded together, batched in one context (default {SERVE_SLOTS})",
    )
    p.add_argument(
        "--queue-size",
        type=counted("queue_size"),
        default=DEFAULT_QUEUE_SIZE,
        help="admission queue length",
    )


def _add_deadline_options(p: argparse.ArgumentParser) -> None:
    """How long a request, a thinking model's reasoning, a load, a shutdown and an idle
    model may take."""
    p.add_argument(
        "--first-token-timeout", type=positive_duration, help="seconds (default: no limit)"
    )
    p.add_argument(
        "--total-timeout",
        type=duration,
        default=SERVE_TOTAL_TIMEOUT_S,
        help="seconds from enqueue to the end of a request "
        f"(default {SERVE_TOTAL_TIMEOUT_S:g}: the bound on a stream whose client reads nothing "
        "while its kernel still accepts bytes; a request's own tokenbelt.total_timeout "
        "overrides it; 0 = no limit)",
    )
    p.add_argument("--stall-timeout", type=positive_duration, help="seconds (default: no limit)")
    p.add_argument(
        "--reasoning-budget",
        type=non_negative_int,
        metavar="TOKENS",
        help="a thinking model's reasoning: at most this many tokens, then its end marker is "
        "forced and the answer starts (default: no budget; a request's own field overrides it)",
    )
    p.add_argument(
        "--reasoning-timeout",
        type=positive_duration,
        metavar="S",
        help="seconds a thinking model may reason before its answer is started "
        "(default: no limit; a request's tokenbelt.reasoning_timeout overrides it)",
    )
    p.add_argument("--load-timeout", type=positive_duration, help="seconds (default: no limit)")
    p.add_argument(
        "--shutdown-grace",
        type=duration,
        default=5.0,
        metavar="S",
        help="on SIGTERM or Ctrl-C, seconds to wait for requests ended with shutdown to be "
        "released and their connections closed (default 5; a second signal exits at once)",
    )
    p.add_argument(
        "--keep-alive",
        type=keep_alive_seconds,
        default=300.0,
        help="seconds idle before unloading, counted from the load and from the end of "
        "the last request (0 = never; at most 31536000, a year)",
    )


def _add_context_options(p: argparse.ArgumentParser) -> None:
    """What each model's context holds and how it decodes: its length, its KV cache's
    element type, drafting."""
    p.add_argument(
        "--n-ctx",
        type=n_ctx,
        default=None,
        help="tokens each request may hold (prompt and reply); not given, what each model "
        "was trained on (the default model: 8192), lowered until its KV cache (--slots "
        "sequences of it) fits 1 GiB; given, at least 64 and at most what the model was "
        "trained on unless --force-n-ctx",
    )
    p.add_argument(
        "--force-n-ctx",
        action="store_true",
        help="allow an --n-ctx past the model's trained context (replies degrade there)",
    )
    p.add_argument(
        "--kv-type",
        choices=KV_TYPES,
        default="f16",
        metavar="TYPE",
        help="the KV cache's element type: f16 or q8_0 (about half the cache's memory; "
        "turns on llama.cpp's flash attention; greedy text then does not depend on what "
        "shares a request's steps; prompts are read slower) (default f16)",
    )
    p.add_argument(
        "--flash-attn",
        choices=FLASH_ATTN,
        default=None,
        metavar="MODE",
        help="llama.cpp's flash attention: auto (on where the device has it, the CPU "
        "included), on, or off (attention over every cell in use; only with an f16 KV "
        "cache) (default auto)",
    )
    p.add_argument(
        "--draft",
        choices=DRAFT_MODES,
        default="lookup",
        metavar="MODE",
        help="prompt-lookup drafting for requests that do not choose (tokenbelt.draft): "
        "lookup verifies tokens taken from the request's own earlier text in one step, "
        "which speeds up replies that copy it (edits, quotes, code), where this model's "
        "measured row costs and the request's measured acceptance say it pays, and "
        "nowhere else; off never drafts. Greedy text is the same either way with a q8_0 KV "
        "cache (default lookup)",
    )


def _add_cache_options(p: argparse.ArgumentParser) -> None:
    """The prefix cache: how much of it each model keeps in memory and on disk."""
    p.add_argument(
        "--prefix-cache-dir",
        type=_cache_dir,
        metavar="DIR",
        help="keep each model's prefix cache here when it unloads (idle, evicted, "
        "stopped) and read it back when it loads again, so the next turn of a long "
        "conversation reuses its prompt instead of computing it again, which costs more "
        "than the read (default: prefix-cache under tokenbelt's cache folder; on, since "
        "the files are only a cache: removing them costs a prefill, not an answer)",
    )
    p.add_argument(
        "--cache-tokens",
        type=counted("cache_tokens"),
        default=None,
        help="the most prompt tokens each model's prefix cache keeps, in memory; a longer "
        "prompt keeps its head (default: as many as "
        f"{DEFAULT_CACHE_MEMORY >> 20} MiB of the model's KV cells hold, at least 4096: "
        "the default model's is 46,603, so an agent's system prompt, tools and history "
        "are read once, not at every turn)",
    )
    p.add_argument(
        "--cache-reuse",
        type=counted("cache_reuse"),
        default=None,
        metavar="N",
        help="past the part a new prompt shares with a cached one, keep each chunk of at "
        "least N cached tokens the prompt holds further on, moved to where it has them, as "
        "llama.cpp's --cache-reuse (a code completion's suffix after a keystroke; code "
        "completions only); a reply from moved cells may differ from one computed cold (default "
        f"{DEFAULT_CACHE_REUSE}; 0 = off)",
    )
    p.add_argument(
        "--prefix-cache-disk",
        type=byte_size,
        default=DEFAULT_PREFIX_CACHE_DISK,
        metavar="SIZE",
        help="the most bytes (1GiB, 500MB...) the prefix-cache folder holds, all models "
        "together; least recently used models go first (default 1073741824 bytes, 1GiB; "
        "0 = off, nothing is written)",
    )


def _cache_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"not a directory: {text!r}")
    return path


def add_access_options(p: argparse.ArgumentParser) -> None:
    """Who may call it, and how long a connection may take."""
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this Bearer key; repeat it to give each client its own key (a "
        "request is then read and cancelled only with the key that made it); required "
        "when binding a non-loopback address (default: $TOKENBELT_API_KEY)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("TOKENBELT_ADMIN_KEY") or None,
        metavar="KEY",
        help="a key that sees and cancels every client's requests "
        "(default: $TOKENBELT_ADMIN_KEY, or none)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header is NAME (any port; repeatable; '*' for "
        "any), so a web page cannot reach the server through a DNS name of its own "
        "(default: localhost, 127.0.0.1 and [::1] only; any name when binding a "
        "non-loopback address)",
    )
    p.add_argument(
        "--reader-timeout",
        type=duration,
        default=30.0,
        metavar="S",
        help="end a stream whose client accepts nothing for S seconds (reader_timeout) and "
        "close its connection (default 30; 0 = never)",
    )
    p.add_argument(
        "--responses-store",
        type=byte_size,
        default=0,
        metavar="SIZE",
        help="keep /v1/responses objects within SIZE bytes (64MiB, 500kB...) for "
        "previous_response_id, GET, background and resumed streams (default 0: none, the "
        "server is stateless and says so)",
    )
    p.add_argument(
        "--responses-builtin-tools",
        choices=("skip", "refuse"),
        default="skip",
        help="what /v1/responses does with a built-in tool (web_search...), which a local "
        "server cannot run: skip leaves it out and names it in tokenbelt.skipped_tools and "
        "the log (default skip: Codex sends its own with every request); refuse answers "
        "400 naming it",
    )
    p.add_argument(
        "--responses-skip-tool",
        action="append",
        default=[],
        metavar="TYPE",
        help="with --responses-builtin-tools refuse, still leave built-in tools of TYPE "
        "out (repeatable; default none)",
    )
    p.add_argument(
        "--responses-ttl",
        type=positive_duration,
        default=3600.0,
        metavar="S",
        help="forget a stored response S seconds after its last use (default 3600)",
    )
    p.add_argument(
        "--read-timeout",
        type=duration,
        default=30.0,
        metavar="S",
        help="answer 408 and close a connection that has not sent a whole request within "
        "S seconds (default 30; 0 = never)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="allow this browser origin (repeatable; default: none)",
    )
