"""``tokenbelt serve``: the OpenAI-compatible service and the web page, on uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .._defaults import (
    DEFAULT_CACHE_TOKENS,
    DEFAULT_CAPACITY,
    DEFAULT_MAX_TOKENS,
    DEFAULT_QUEUE_SIZE,
    SERVE_SLOTS,
    SERVE_TOTAL_TIMEOUT_S,
)
from .._heap import freeze_startup_heap
from ..engines import DEFAULT_PREFIX_CACHE_DISK, DRAFT_MODES, KV_TYPES
from ..runtime import DEFAULT_ALIAS, DEFAULT_SHARE
from ._common import (
    Parser,
    add_isolation_options,
    add_thread_options,
    byte_size,
    counted,
    duration,
    fail,
    keep_alive_seconds,
    missing_model_file,
    n_ctx,
    non_negative_int,
    positive_duration,
    startup_line,
)
from ._served import model_settings, options_for, served_aliases

if TYPE_CHECKING:
    import uvicorn

    from ..runtime import Runtime
    from ..server import ServerSettings

logger = logging.getLogger("tokenbelt.server")

#: SO_SNDBUF of every connection (the kernel doubles it): see ``main``.
SEND_BUFFER_BYTES = 32 * 1024


def _port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bound: str, extra: list[str]) -> tuple[str, ...]:
    """The Host names served: the loopback names, ``extra``, and any for a public bind.

    A server bound beyond loopback needs an API key, which a rebinding page lacks; its
    clients reach it by names this process cannot know.
    """
    names = ["localhost", "127.0.0.1", "[::1]", *extra]
    if not is_loopback(bound):
        names.append("*")
    return tuple(names)


def _add_model_options(p: argparse.ArgumentParser) -> None:
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


def _add_serving_options(p: argparse.ArgumentParser) -> None:
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
        help="tokens each request may hold; not given, lowered to what a model was "
        "trained on (default 4096; at least 64, at most what the model was trained on "
        "unless --force-n-ctx)",
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
        "--draft",
        choices=DRAFT_MODES,
        default="off",
        metavar="MODE",
        help="prompt-lookup drafting for requests that do not choose (tokenbelt.draft): "
        "lookup verifies tokens taken from the request's own earlier text in one step, "
        "which speeds up replies that copy it (edits, quotes, code) and turns itself off "
        "per request where it does not pay; the text is the same either way (default off)",
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
        default=DEFAULT_CACHE_TOKENS,
        help="the most prompt tokens each model's prefix cache keeps, in memory; a longer "
        "prompt keeps its head: raise it for an agent whose prompt is longer "
        f"(default {DEFAULT_CACHE_TOKENS})",
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


def _prefix_cache_dir(args: argparse.Namespace) -> Path | None:
    if not args.prefix_cache_disk:
        return None
    if args.prefix_cache_dir is not None:
        return Path(args.prefix_cache_dir)
    from ..models import Home

    return Home.from_env().cache_dir / "prefix-cache"


def _add_access_options(p: argparse.ArgumentParser) -> None:
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
        "--responses-skip-tool",
        action="append",
        default=[],
        metavar="TYPE",
        help="leave built-in tools of TYPE (web_search, namespace...) out of a /v1/responses "
        "request instead of refusing it (repeatable; each is named in tokenbelt.skipped_tools; "
        "default: none, every built-in tool is refused by name)",
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


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API with a web chat",
        description="Serve a model (default: the embedded one) at http://127.0.0.1:8080.",
    )
    _add_model_options(p)
    _add_serving_options(p)
    add_thread_options(p)
    add_isolation_options(p, default="process")
    _add_access_options(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="how much the server logs to stderr",
    )
    p.add_argument(
        "--check-invariants",
        action="store_true",
        help="check every request's timeline as it happens; a broken invariant is logged "
        "and counted in /metrics (also TOKENBELT_CHECK_INVARIANTS=1)",
    )
    p.set_defaults(func=main)
    p.epilog = (
        f"A reply is at most {DEFAULT_MAX_TOKENS} tokens unless a request sets max_tokens.\n\n"
        f"{p.epilog}"
    )


def _api_keys(args: argparse.Namespace) -> list[str]:
    """The client keys (``--api-key`` or ``$TOKENBELT_API_KEY``); exits on a bad one."""
    from_env = os.environ.get("TOKENBELT_API_KEY") or None
    keys: list[str] = args.api_key or ([from_env] if from_env else [])
    for key in [*keys, *([args.admin_key] if args.admin_key is not None else [])]:
        if not key.strip() or key != key.strip():
            fail("an API key is blank or has white space around it: give a real key", 2)
    if not is_loopback(args.host) and not keys:
        fail(
            f"binding {args.host} exposes the model to the network: "
            "give --api-key (or TOKENBELT_API_KEY), or bind 127.0.0.1",
            2,
        )
    return keys


def _check_context(alias: str | None, args: argparse.Namespace, n_ctx: int | None) -> None:
    """Fail fast on an alias the catalog does not know (or a given ``--n-ctx`` past what
    a chat model was trained on), before binding anything; downloading and loading then
    happen in the background. The default context is lowered to fit each model, and an
    embedding or rerank model takes at most its own, whatever is given."""
    from ..runtime import Runtime, context_for

    if alias and Runtime.name_for(alias) == alias:
        from ..models import Catalog, Home, ModelCache, choose_variant, find_remote

        home = Home.from_env()
        if find_remote(alias, home) is None:
            choice = choose_variant(Catalog.load(home), alias, cache=ModelCache(home))
            trained = choice.entry.context_length
            context = context_for(n_ctx, trained, choice.entry.kind)
            if trained and context > trained and not args.force_n_ctx:
                fail(
                    f"n_ctx {context} is more than {alias} was trained on ({trained} "
                    "tokens): give a smaller --n-ctx, or add --force-n-ctx",
                    2,
                )


def _upstream_key(args: argparse.Namespace) -> str | None:
    if not args.upstream_api_key_env:
        return None
    upstream_key = os.environ.get(args.upstream_api_key_env)
    if not upstream_key:
        fail(f"the environment variable {args.upstream_api_key_env} is not set", 2)
    return upstream_key


def _settings(args: argparse.Namespace, keys: list[str]) -> ServerSettings:
    """The HTTP side only: how requests are bounded is the runtime's (``_runtime``)."""
    from ..server import ServerSettings

    return ServerSettings(
        api_key=keys[0] if keys else None,
        api_keys=tuple(keys[1:]),
        admin_key=args.admin_key,
        cors_origins=tuple(args.cors_origin),
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        reader_timeout=args.reader_timeout or None,
        read_timeout=args.read_timeout or None,
        responses_store_bytes=args.responses_store,
        responses_ttl_s=args.responses_ttl,
        responses_skip_tools=tuple(args.responses_skip_tool),
        reasoning_budget=args.reasoning_budget,
        reasoning_timeout=args.reasoning_timeout,
    )


def _runtime(args: argparse.Namespace) -> Runtime:
    """The runtime, the one owner of each request's capacity, slots, queue and deadlines."""
    from ..belt import Limits
    from ..runtime import Runtime, default_budget

    budget = args.memory_budget

    limits = Limits(
        first_token=args.first_token_timeout,
        total=args.total_timeout or None,
        stall=args.stall_timeout,
    )
    return Runtime(
        slots=args.slots,
        queue_size=args.queue_size,
        capacity=args.capacity,
        limits=limits,
        keep_alive=args.keep_alive or None,
        n_ctx=args.n_ctx,
        force_n_ctx=args.force_n_ctx,
        kv_type=args.kv_type,
        draft=args.draft,
        n_threads=args.threads,
        n_threads_batch=args.threads_batch,
        decode_nice=args.decode_nice,
        prefill_chunk=args.prefill_chunk,
        prefill_gap=args.prefill_gap,
        isolation=args.isolation,
        stop_grace=args.stop_grace,
        memory_budget=default_budget() if budget is None else budget or None,
        prefix_cache_dir=_prefix_cache_dir(args),
        prefix_cache_disk=args.prefix_cache_disk,
        cache_tokens=args.cache_tokens,
    )


def _bind(config: uvicorn.Config, host: str, port: int) -> socket.socket:
    """Bind the listening socket here (so ``--port 0`` can log the real port). A bind
    that fails is one line of tokenbelt's, with the system's reason: uvicorn's own log
    line about it is held back."""
    held: list[str] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record.getMessage())
        return False

    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(hold)
    try:
        sock: socket.socket = config.bind_socket()
        return sock
    except SystemExit:
        why = f": {held[-1]}" if held else " (is the port in use?)"
        fail(f"cannot listen on {host}:{port}{why}")
    finally:
        uvicorn_log.removeFilter(hold)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server import GracefulServer, create_app, http_protocol

    keys = _api_keys(args)
    aliases = served_aliases(args, DEFAULT_ALIAS)
    for served in aliases:
        missing = missing_model_file(served)
        if missing is not None:
            fail(f"file not found: {missing}")
        _check_context(served, args, options_for(served, args).get("n_ctx", args.n_ctx))
    alias = aliases[0] if aliases else None
    upstream_key = _upstream_key(args)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    if args.check_invariants:
        from ..belt import invariants

        invariants.enable()
    settings = _settings(args, keys)
    runtime = _runtime(args)
    if args.upstream:
        models = runtime.add_upstreams(
            args.upstream,
            api_key=upstream_key,
            max_concurrency=args.upstream_concurrency,
            health_interval=args.upstream_health_interval or None,
        )
        logger.info("from upstreams: %s", ", ".join(m.name for m in models))
    for later in aliases[1:]:  # registered now (an unknown alias fails now), loaded on demand
        runtime.load(later, lazy=True, load_timeout=args.load_timeout, **options_for(later, args))
    first = {"load_timeout": args.load_timeout, **(options_for(alias, args) if alias else {})}
    app = create_app(runtime, settings, load=alias, load_options=first)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http=http_protocol(settings.read_timeout),
    )
    server = GracefulServer(config, app.state.tokenbelt, grace=args.shutdown_grace)
    sock = _bind(config, args.host, args.port)
    # Accepted connections inherit this. Left to autotuning, the kernel grows a send
    # buffer to megabytes, and a client that stops reading would let generation run
    # thousands of tokens ahead; fixed, it pauses after a few hundred.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    logger.info(
        "loading %s; serving at %s (web chat at /, API at /v1, metrics at /metrics)",
        alias or ", ".join(runtime.models),
        url,
    )
    app.state.tokenbelt.on_ready = lambda model: logger.info(
        "ready: %s", startup_line(model, runtime, url)
    )
    freeze_startup_heap()
    server.run(sockets=[sock])
    logger.info("shutdown: stopped")
    return 0
