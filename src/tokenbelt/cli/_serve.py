"""``tokenbelt serve``: the OpenAI-compatible service and the web page, on uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .._defaults import DEFAULT_MAX_TOKENS
from .._heap import freeze_startup_heap
from ..engines import LlamaConfig
from ..runtime import DEFAULT_ALIAS
from ._common import (
    Parser,
    add_isolation_options,
    add_thread_options,
    fail,
    missing_model_file,
    startup_line,
)
from ._serve_options import add_access_options, add_model_options, add_serving_options
from ._served import options_for, served_aliases

if TYPE_CHECKING:
    import uvicorn

    from ..runtime import Runtime
    from ..server import ServerSettings

logger = logging.getLogger("tokenbelt.server")

#: SO_SNDBUF of every connection (the kernel doubles it): see ``main``.
SEND_BUFFER_BYTES = 32 * 1024


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


def _prefix_cache_dir(args: argparse.Namespace) -> Path | None:
    if not args.prefix_cache_disk:
        return None
    if args.prefix_cache_dir is not None:
        return Path(args.prefix_cache_dir)
    from ..models import Home

    return Home.from_env().cache_dir / "prefix-cache"


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API with a web chat",
        description="Serve a model (default: the embedded one) at http://127.0.0.1:8080.",
    )
    add_model_options(p)
    add_serving_options(p)
    add_thread_options(p)
    add_isolation_options(p, default="process")
    add_access_options(p)
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
    from ..models import is_speech_model
    from ..runtime import Runtime, context_for

    if alias and Runtime.name_for(alias) == alias and not is_speech_model(alias):
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
        responses_builtin_tools=args.responses_builtin_tools,
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
        isolation=args.isolation,
        stop_grace=args.stop_grace,
        memory_budget=default_budget() if budget is None else budget or None,
        engine=_engine(args),
    )


def _engine(args: argparse.Namespace) -> LlamaConfig:
    """The engine's configuration from the flags: every flag whose ``dest`` is a field of
    ``LlamaConfig`` (a new engine setting needs its field and its flag, nothing here);
    ``slots`` and ``n_ctx`` are the runtime's (each model's own at its load)."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)} - {"slots", "n_ctx"}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    given["n_threads"] = args.threads
    given["n_threads_batch"] = args.threads_batch
    given["prefix_cache_dir"] = _prefix_cache_dir(args)
    return LlamaConfig(**given)


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
