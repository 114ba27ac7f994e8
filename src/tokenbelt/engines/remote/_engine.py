"""The remote engine: a request's tokens come from an OpenAI-compatible upstream.

One event-loop thread per engine serves every request with one ``aiohttp`` session:
no thread per request (aiohttp rather than httpx: a request to an upstream on loopback
took 0.6 ms against httpx's 1.5 ms here, and that is paid before every first token).
Each request is one task that

- picks an upstream (``UpstreamPool``: least outstanding requests, ejection), always
  asks it for a *streaming* answer (``stream_options.include_usage``), even for a
  client that asked for one JSON body, so that a stop can end it at any point;
- waits for room on the belt before it reads the next event from the socket: a
  paused reader stops the reads, the kernel's receive buffer fills and TCP pushes
  back on the upstream;
- on any end (a stop, a deadline, shutdown) closes the upstream connection at once.
  A ``user_cancel`` at a tokenbelt upstream first calls its cancel endpoint (one
  round trip), so that the upstream records ``user_cancel`` too; any other stop just
  closes the connection, which the upstream records as ``client_disconnect``. From a
  tokenbelt upstream the engine then fetches that request's own trace (same request
  id, passed in ``x-request-id``) and keeps it in ``trace.upstream``: the front's
  release comes after the upstream's (or after ``UPSTREAM_RELEASE_WAIT_S``);
- says in ``trace.upstream["release"]`` what it knows of the upstream's end, and never
  claims more (``_release.py``): ``finished``, ``upstream_ended``, ``confirmed`` (stopped
  here, and the upstream showed it let go: a tokenbelt's trace, vLLM's ``/metrics``,
  llama.cpp's ``/slots``; ``release_by`` and ``released_at`` say which and when) or
  ``unconfirmed`` (``release_why``: llama-cpp-python's server and Ollama keep nothing a
  front can read);
- probes what each upstream is (``_kinds.py``), passes through the options that kind
  takes and refuses the rest before any request, naming the upstream;
- retries on another upstream when one refuses, answers 5xx or breaks off, but only
  while no token has reached the belt.

Memory per request is bounded by ``capacity`` pieces on the belt, aiohttp's read
buffer (it stops reading the socket at twice ``READ_BUFFER_BYTES``), one unfinished
event line (at most ``MAX_EVENT_BYTES``) and the socket's receive buffer
(``_session.RECEIVE_BUFFER_BYTES``, which the kernel doubles): about 520 KiB plus the pieces,
whatever the upstream does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from ..._errors import Cancelled, InvalidArgument, UpstreamError, UpstreamUnavailable
from ...belt import EndReason, Producer
from .._base import OnExit, check_can_start, run_to_end
from .._request import GenerationRequest, SamplingParams, refuse
from .._statistics import EngineStatistics, UpstreamStatistics
from ._kinds import GRAMMAR, OPTIONS, Kind, probe
from ._relay import Job, relay
from ._release import RELEASE_WAIT_S, abort_at, settle
from ._session import new_loop, open_session
from ._upstreams import UpstreamPool, UpstreamState
from ._wire import estimate_tokens, event_data, raise_for_status, request_body

# aiohttp takes a fifth of a second to import: it is imported where it is first used, so a
# process that never speaks to an upstream (a worker, a CLI command, a local serve)
# does not pay for it.
if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger("tokenbelt.engines.remote")

#: how long the engine waits for a tokenbelt upstream's cancel answer
UPSTREAM_RELEASE_WAIT_S = RELEASE_WAIT_S
#: how long a probe of what an upstream is may take at the engine's start
PROBE_WAIT_S = 1.0
#: options the front cannot relay, whatever the upstream
NOT_RELAYED = ("logprobs", "return_token_ids", "reasoning_budget", "reasoning_timeout")


class RemoteEngine:
    """A model served by one or more upstream OpenAI-compatible servers.

    A batch-shaped engine: ``start(request, producer, on_exit)`` never blocks, and
    up to ``slots`` requests (the sum of the upstreams' concurrency limits) run at
    once on the engine's event loop. For each request the engine calls
    ``producer.start()``, then ``finish``/``fail`` (or sees the stop), closes the
    upstream stream, runs ``on_exit()`` and ``producer.release()``.
    ``health_interval`` seconds apart (None: never) each upstream's ``/v1/models``
    is asked whether it answers: an ejected upstream that does is back in at once.
    """

    #: the upstream applies its own template: tools are described in the messages
    template_tools = False
    tool_format = "tokenbelt"
    reasoning = None

    def __init__(
        self,
        pool: UpstreamPool,
        *,
        name: str,
        context_length: int = 0,
        health_interval: float | None = 5.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.pool = pool
        self.name = name
        self.context_length = context_length
        self.slots = pool.slots
        self.health_interval = health_interval
        self._jobs: set[Job] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._loop = new_loop()
        self._health: asyncio.Task[None] | None = None
        #: health-check rounds that failed (logged; the next round ran)
        self.health_failures = 0
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"tokenbelt-remote-{name}", daemon=True
        )
        self._thread.start()
        self._session = asyncio.run_coroutine_threadsafe(
            open_session(connect_timeout), self._loop
        ).result()
        probing = asyncio.run_coroutine_threadsafe(self._probe_all(), self._loop)
        with contextlib.suppress(TimeoutError):  # those still unknown: at a health check
            probing.result(PROBE_WAIT_S)
        if health_interval is not None:
            asyncio.run_coroutine_threadsafe(self._start_health(health_interval), self._loop)

    # -- the engine interface -----------------------------------------------------------------

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """An estimate (the upstream's usage replaces it); a prompt too long for the
        upstream's context comes back as the upstream's own 400."""
        refuse(request.sampling, "remote", *NOT_RELAYED)
        self._refuse_per_upstream(request)
        if request.sampling.think not in (None, False):  # false asks nothing of it
            raise InvalidArgument("think is not supported by the remote engine", param="think")
        if not request.reuse_prefix:
            raise InvalidArgument(
                "cache_prompt: false is not supported by the remote engine: the upstream "
                "decides what it caches",
                param="cache_prompt",
            )
        if request.continue_final:
            raise InvalidArgument(
                "continuing a final assistant turn is not supported by the remote engine: "
                "the upstream renders the chat template",
                param="messages",
            )
        if request.draft == "lookup":
            raise InvalidArgument(
                "draft: lookup is not supported by the remote engine: the upstream decides "
                "how it decodes",
                param="draft",
            )
        if request.prompt_tokens is not None:
            return len(request.prompt_tokens)
        if request.prompt is not None:
            return estimate_tokens(request.prompt)
        return estimate_tokens(" ".join(m["content"] for m in request.messages or ()))

    def _refuse_per_upstream(self, request: GenerationRequest) -> None:
        """An option that some upstream of this model does not take is refused, naming it
        (any upstream may serve the request)."""
        defaults = SamplingParams()
        for state in self.pool.states:
            if request.grammar is not None:
                where = f"upstream {state.upstream.url} ({state.probed.kind.value})"
                if state.probed.kind not in GRAMMAR:
                    raise InvalidArgument(
                        f"{where} cannot constrain output with a grammar (a JSON schema, "
                        "tool calls)"
                    )
                if request.grammar.triggers:
                    raise InvalidArgument(
                        f"{where} cannot apply a grammar from a trigger on: "
                        'use tool_choice "required" or a named function',
                        param="tool_choice",
                    )
            for name in sorted(OPTIONS[Kind.TOKENBELT] - state.probed.options()):
                if getattr(request.sampling, name) != getattr(defaults, name):
                    raise InvalidArgument(
                        f"{name} is not supported by upstream {state.upstream.url} "
                        f"({state.probed.kind.value})",
                        param=name,
                    )

    def start(
        self, request: GenerationRequest, producer: Producer[str], on_exit: OnExit | None = None
    ) -> None:
        """Hand a request to the engine's loop; never blocks."""
        job = Job(request, producer, on_exit or (lambda: None))
        with self._lock:
            check_can_start(self._closed, len(self._jobs), self.slots, "upstream slots")
            self._jobs.add(job)
        self._loop.call_soon_threadsafe(self._spawn, job)

    def generate(self, request: GenerationRequest, producer: Producer[str]) -> EndReason:
        """Blocking: one request, for a caller that wraps the engine in ``belt.produce``."""
        return run_to_end(self.start, request, producer)

    def upstreams(self) -> list[UpstreamStatistics]:
        """A snapshot of every upstream's counters (any thread)."""
        return self.pool.statistics()

    def statistics(self) -> EngineStatistics:
        """Slots, requests running and every upstream's counters (any thread)."""
        with self._lock:
            running = len(self._jobs)
        return EngineStatistics(self.slots, running, upstreams=tuple(self.upstreams()))

    # -- one request --------------------------------------------------------------------------

    def _spawn(self, job: Job) -> None:
        task = self._loop.create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job: Job) -> None:
        p = job.producer
        loop = asyncio.get_running_loop()
        try:
            p.start()
            job.fetch = loop.create_task(self._fetch(job))

            def on_cancel(reason: EndReason) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nothing to stop
                    loop.call_soon_threadsafe(self._stop, job, reason)

            p.on_cancel(on_cancel)
            await asyncio.wait({job.fetch})
            self._record_end(job, job.fetch)
            if job.state is not None:
                await settle(self._session, job, self._headers(job.state))
        except BaseException:
            # This task itself was cancelled (the loop shuts down): the request too.
            if job.fetch is not None:
                job.fetch.cancel()
            p.cancel(EndReason.SHUTDOWN)
            raise
        finally:
            with self._lock:
                self._jobs.discard(job)
            try:
                job.on_exit()
            finally:
                p.release()

    @staticmethod
    def _record_end(job: Job, fetch: asyncio.Task[EndReason]) -> None:
        p = job.producer
        if fetch.cancelled():
            # A stop (the belt holds its reason already), or the loop shutting down.
            p.cancel(EndReason.SHUTDOWN)
            return
        error = fetch.exception()
        if error is None:
            p.finish(fetch.result())
        elif not isinstance(error, Cancelled):
            p.fail(error)

    def _stop(self, job: Job, reason: EndReason) -> None:
        """On the loop, for a stop: end the fetch, whose exit closes the upstream stream.

        A vLLM that serves its abort route is called there too, with its id of the
        request. A ``user_cancel`` at a tokenbelt upstream is sent first: httpcore closes the
        connection at once when a read is cancelled, and the upstream would record a
        ``client_disconnect`` instead.
        """
        fetch = job.fetch
        if fetch is None or fetch.done():
            return
        state = job.state
        if state is not None and state.probed.kind is Kind.VLLM and state.probed.abort_route:
            # Beside the close, not before it: a router between may not pass a close on.
            aborting = self._loop.create_task(abort_at(self._session, job, self._headers(state)))
            job.aborting = aborting
            self._tasks.add(aborting)
            aborting.add_done_callback(self._tasks.discard)
        cancelling = self._upstream_cancel(job)
        if cancelling is None:
            fetch.cancel()
        else:
            cancelling.add_done_callback(lambda _task: fetch.cancel())

    def _upstream_cancel(self, job: Job) -> asyncio.Task[None] | None:
        """The call to a tokenbelt upstream's cancel endpoint for a ``user_cancel``
        (started once), or None when there is none to make."""
        state = job.state
        if job.producer.end_reason is not EndReason.USER_CANCEL or state is None:
            return None
        if not state.tokenbelt:
            return None
        if job.cancelling is None:
            job.cancelling = self._loop.create_task(self._cancel_at(job, state))
            self._tasks.add(job.cancelling)
            job.cancelling.add_done_callback(self._tasks.discard)
        return job.cancelling

    async def _cancel_at(self, job: Job, state: UpstreamState) -> None:
        import aiohttp

        request_id = job.upstream_id or job.producer.trace.request_id
        try:
            async with self._session.post(
                f"{state.upstream.url}/v1/requests/{request_id}/cancel",
                headers=self._headers(state),
                timeout=aiohttp.ClientTimeout(total=UPSTREAM_RELEASE_WAIT_S),
            ) as answer:
                logger.debug("cancel at %s: %s", state.upstream.url, await answer.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("cancel at %s failed: %r", state.upstream.url, exc)

    async def _close_upstream(
        self, job: Job, response: aiohttp.ClientResponse, events: AsyncGenerator[str, None]
    ) -> None:
        """Close the upstream stream, after the upstream's own cancel if there is one.

        A body read to its end gives its connection back for the next request; any
        other is closed, which is what tells an upstream to stop.
        """
        try:
            cancelling = self._upstream_cancel(job)
            if cancelling is not None:
                await cancelling
        finally:
            try:
                await events.aclose()
            finally:
                if response.content.at_eof():
                    response.release()
                else:
                    response.close()

    # -- talking to upstreams ------------------------------------------------------------------

    async def _fetch(self, job: Job) -> EndReason:
        """Try upstreams until one streams the answer; retry only before the first token."""
        tried: list[UpstreamState] = []
        while True:
            state = await self.pool.acquire(tried)
            job.state = state
            try:
                return await self._attempt(job, state)
            except UpstreamUnavailable as exc:
                self.pool.failed(state, str(exc))
                self.pool.eject(state, str(exc))
                if job.produced:
                    raise
                tried.append(state)
                logger.info("retrying %s elsewhere: %s", job.producer.trace.request_id, exc)
            except UpstreamError as exc:
                self.pool.failed(state, str(exc))
                raise
            finally:
                self.pool.release(state)

    @staticmethod
    def _headers(state: UpstreamState) -> dict[str, str]:
        u = state.upstream
        headers = dict(u.headers)
        if u.api_key:
            headers["authorization"] = f"Bearer {u.api_key}"
        return headers

    async def _attempt(self, job: Job, state: UpstreamState) -> EndReason:
        import aiohttp

        u = state.upstream
        chat = job.request.messages is not None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = self._headers(state)
        kind = state.probed.kind
        if kind in (Kind.TOKENBELT, Kind.VLLM):
            # The same id on both sides (llama.cpp's server wants a UUID; vLLM takes any).
            headers["x-request-id"] = job.producer.trace.request_id
        headers["content-type"] = "application/json"
        sent = time.monotonic()
        body = json.dumps(request_body(job.request, u.model, kind)).encode()
        try:
            response = await self._session.post(u.url + path, data=body, headers=headers)
            # Held here until the close: an event reader dropped earlier would be
            # finalised by the loop, closing the connection before a cancel is sent.
            events = event_data(response)
            try:
                if response.status >= 400:
                    await raise_for_status(response, u.url)
                job.upstream_id = response.headers.get("x-request-id")
                job.producer.trace.upstream = {
                    "url": u.url,
                    "model": u.model,
                    **state.probed.describe(),
                    "request_id": job.upstream_id,
                }
                return await relay(job, self.pool, state, events, chat, sent)
            finally:
                # Shielded: a stop that lands while the stream is being closed must not
                # interrupt the close, or the connection would stay open, and the
                # upstream would go on generating for nobody.
                closing = self._loop.create_task(self._close_upstream(job, response, events))
                self._tasks.add(closing)
                closing.add_done_callback(self._tasks.discard)
                await asyncio.shield(closing)
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailable(f"upstream {u.url} refused the connection ({exc})") from exc
        except TimeoutError as exc:
            raise UpstreamUnavailable(f"upstream {u.url} did not answer in time ({exc!r})") from exc
        except aiohttp.ClientError as exc:
            what = type(exc).__name__
            raise UpstreamUnavailable(
                f"the connection to upstream {u.url} broke off ({what}: {exc})"
            ) from exc

    # -- health ------------------------------------------------------------------------------

    async def _probe(self, state: UpstreamState) -> None:
        """Find out what ``state`` is (a few GETs; an upstream down stays unknown)."""
        found = await probe(
            self._session, state.upstream.url, self._headers(state), tokenbelt=state.tokenbelt
        )
        if not state.tokenbelt:  # an answer meanwhile may have said more
            state.probed = found
        if found.done:
            logger.info("upstream %s is %s", state.upstream.url, found.describe())

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.pool.states))

    async def _start_health(self, interval: float) -> None:
        self._health = asyncio.get_running_loop().create_task(self._check_health(interval))

    async def check(self, state: UpstreamState) -> bool:
        """Ask one upstream's ``/v1/models``; True when it answers 200 (on the loop)."""
        import aiohttp

        try:
            # Its own connection, closed after: never one a request would reuse.
            async with self._session.get(
                f"{state.upstream.url}/v1/models",
                headers={**self._headers(state), "connection": "close"},
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as response:
                status = response.status
                body = await response.read() if status == 200 else b""
        except TimeoutError as exc:
            # Slow, not down: an upstream busy with requests of ours may answer late (one
            # that serves one request at a time answers after it); those requests say
            # whether it works. An idle one that does not answer is taken out.
            if state.in_flight == 0:
                self.pool.eject(state, f"health check: {type(exc).__name__}")
            return False
        except aiohttp.ClientError as exc:
            self.pool.eject(state, f"health check: {type(exc).__name__}: {exc}")
            return False
        if status != 200:
            self.pool.eject(state, f"health check: status {status}")
            return False
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            data = json.loads(body).get("data") or []
            if any(isinstance(m, dict) and isinstance(m.get("tokenbelt"), dict) for m in data):
                state.seen_tokenbelt()
        if not state.probed.done:
            await self._probe(state)
        self.pool.readmit(state)
        return True

    async def _check_health(self, interval: float) -> None:
        """Check every upstream each ``interval`` seconds until cancelled. A round that
        fails is logged and counted (``health_failures``) and the next one runs: a task
        that ended would leave an ejected upstream out for ever, silently."""
        while True:
            try:
                await asyncio.gather(*(self.check(s) for s in self.pool.states))
            except Exception:
                self.health_failures += 1
                logger.exception("a health check of %s failed; the checks go on", self.name)
            await asyncio.sleep(interval)

    # -- lifecycle ---------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.producer.cancel(EndReason.SHUTDOWN)
        if self._health is not None:
            self._health.cancel()
        pending = set(self._tasks) | ({self._health} if self._health else set())
        if pending:
            await asyncio.wait(pending, timeout=10.0)
        await self._session.close()

    def close(self) -> None:
        """Stop every request (``shutdown``), close the connections, end the loop thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()
