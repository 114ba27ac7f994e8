"""The probe: one model's whole life on this machine, measured step by step.

Steps, in order: ``resolve`` (catalog, device, fetch), ``verify`` (size, sha256),
``load`` (under ``load_timeout``), ``stream`` (a short reply: time to first token,
decode rate), ``draft`` (whether prompt-lookup drafting pays here: a reply that copies
its prompt, drafting asked off and then left to decide, and the row costs the engine
measured), ``cancel_prefill`` (a stop inside a ~2000-token prefill),
``cancel_decode`` (a stop while tokens stream), ``unload`` (process RSS returned; with
``isolation="process"`` the model runs in a worker process, and unloading ends it: the
report has the worker's RSS loaded and after unload).

The engine is driven directly, the way the runtime drives it: a ``Belt``, a producer
thread running ``belt.produce(engine.generate...)``, the consumer on this thread. A
failing step ends the probe; the report names it and says what to do.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .._errors import (
    CatalogError,
    DownloadError,
    IntegrityError,
    LoadTimeout,
    TokenbeltError,
    UnknownModel,
)
from ..belt import Belt, EndReason
from ..engines import (
    BatchEngine,
    BatchStatistics,
    GenerationRequest,
    SamplingParams,
    WorkerEngine,
)
from ._cache import ModelCache
from ._catalog import Catalog
from ._device import DeviceInfo, detect_device
from ._download import DownloadTimeouts, ProgressCallback
from ._home import Home
from ._resolve import DEFAULT_ALIAS, choose_variant

MIB = 1024 * 1024
PREFILL_TOKENS = 2000
#: seconds into a worker's prefill at which the probe stops it
_INTO_PREFILL_S = 0.05
#: the engines the probe drives: in this process, or in a worker process
_Engine = BatchEngine | WorkerEngine
_FILLER = "The conveyor belt carries small plates of sushi past the guests at the counter. "
_COUNTING = "The numbers from one to one thousand, in order: 1, 2, 3, 4, 5, 6, 7, 8,"
_COPY = "Repeat this line four times, nothing else:\n" + ", ".join(map(str, range(1, 21)))
#: drafting pays where the copying reply decodes at least this much faster with it
DRAFT_PAYS = 1.05


@dataclass
class ProbeReport:
    """What the probe measured. ``ok`` is True only if every step passed."""

    ok: bool = False
    alias: str | None = None
    variant: str | None = None
    device: str | None = None
    device_reason: str | None = None
    model_path: str | None = None
    verified: bool = False
    hashed: bool | None = None
    context_length: int | None = None
    load_s: float | None = None
    ttft_ms: float | None = None
    decode_tok_s: float | None = None
    #: llama.cpp threads the engine used for the decode (the adaptive choice, or the fixed one)
    threads: int | None = None
    reply: str | None = None
    #: a reply that copies its prompt: decode rate with drafting asked off and with the
    #: engine's default (drafting decides for itself), their ratio, what it decided, and
    #: whether it pays here (decided on, and at least ``DRAFT_PAYS`` times faster)
    draft_off_tok_s: float | None = None
    draft_tok_s: float | None = None
    draft_speedup: float | None = None
    draft_decision: str | None = None
    draft_pays: bool | None = None
    #: what a step of n tokens cost over a step of one, as the engine measured it
    #: (drafting verifies a draft as extra rows of a step; n as a string, for JSON)
    draft_row_costs: dict[str, float] | None = None
    prefill_prompt_tokens: int | None = None
    cancel_release_prefill_ms: float | None = None
    #: where the prefill cancel landed: "prefill" (as meant) or "decode" (prefill was faster)
    cancel_prefill_landed: str | None = None
    cancel_release_decode_ms: float | None = None
    rss_before_load_mb: float | None = None
    rss_loaded_mb: float | None = None
    rss_after_unload_mb: float | None = None
    unload_rss_returned_mb: float | None = None
    #: RSS still held after unload compared to before load (native allocator caches)
    unload_rss_residual_mb: float | None = None
    #: where the model ran: "thread" (this process) or "process" (a worker process)
    isolation: str = "thread"
    #: the worker process's RSS while loaded, and after unload (0: the process is gone)
    worker_rss_loaded_mb: float | None = None
    worker_rss_after_unload_mb: float | None = None
    failed_step: str | None = None
    error: str | None = None
    hint: str | None = None
    steps_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _StepFailed(Exception):
    def __init__(self, step: str, error: BaseException | str, hint: str) -> None:
        super().__init__(str(error))
        self.step, self.error, self.hint = step, str(error), hint


def _rss() -> int:
    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _run(
    engine: _Engine,
    request: GenerationRequest,
    belt: Belt[str],
    consume: Callable[[Belt[str]], None],
    step: str,
) -> None:
    """Run one request: producer thread, ``consume(belt)`` here; always joins."""
    belt.trace.mark_enqueued()
    producer = threading.Thread(
        target=belt.produce,
        args=(lambda b: engine.generate(request, b.producer),),
        name=f"tokenbelt-probe-{step}",
    )
    producer.start()
    try:
        consume(belt)
    finally:
        belt.close()
        producer.join()
    if belt.end_reason is EndReason.RUNTIME_ERROR:
        raise _StepFailed(step, belt.trace.error or "the engine failed", "see the error above")


def _read_all(belt: Belt[str]) -> None:
    for _piece in belt:
        pass


class _Probe:
    def __init__(self, report: ProbeReport) -> None:
        self.report = report

    def stream(self, engine: _Engine) -> None:
        request = GenerationRequest.chat(
            [{"role": "user", "content": "Say hello in one short sentence."}],
            SamplingParams(max_tokens=32, temperature=0.0, seed=0),
        )
        belt: Belt[str] = Belt(8)
        pieces: list[str] = []
        _run(engine, request, belt, lambda b: pieces.extend(b), "stream")
        if belt.end_reason is None or not belt.end_reason.is_natural or not pieces:
            raise _StepFailed("stream", f"the reply ended with {belt.end_reason}", "run it again")
        r = self.report
        r.reply = "".join(pieces).strip()
        r.ttft_ms = _ms(belt.trace.time_to_first_token)
        rate = belt.trace.decode_rate
        r.decode_tok_s = None if rate is None else round(rate, 1)

    def draft(self, engine: _Engine) -> None:
        """The copying reply twice: drafting asked off, then the engine's default."""
        rates: list[float] = []
        decision = None
        for mode in ("off", None):
            request = GenerationRequest(
                messages=({"role": "user", "content": _COPY},),
                sampling=SamplingParams(max_tokens=96, temperature=0.0),
                draft=mode,
            )
            belt: Belt[str] = Belt(64)  # room for a whole draft in a step
            _run(engine, request, belt, _read_all, "draft")
            rate = belt.trace.decode_rate
            if rate is None:
                raise _StepFailed("draft", "the copying reply was too short to time", "run again")
            rates.append(rate)
            decision = belt.trace.draft_decision
        r = self.report
        r.draft_off_tok_s, r.draft_tok_s = round(rates[0], 1), round(rates[1], 1)
        r.draft_speedup = round(rates[1] / rates[0], 2)
        r.draft_decision = decision
        r.draft_pays = decision == "on" and r.draft_speedup >= DRAFT_PAYS
        stats = engine.statistics()
        costs = stats.row_costs() if isinstance(stats, BatchStatistics) else {}
        r.draft_row_costs = {str(n): round(c, 2) for n, c in costs.items()}

    def long_prompt(self, engine: _Engine) -> GenerationRequest:
        per = len(engine.tokenize_request(GenerationRequest(prompt=_FILLER)))
        prompt = _FILLER * math.ceil(PREFILL_TOKENS / max(1, per - 1))
        while len(engine.tokenize_request(GenerationRequest(prompt=prompt))) >= (
            engine.context_length - 8
        ):
            prompt = prompt[: len(prompt) * 3 // 4]
        return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=8))

    def cancel_prefill(self, engine: _Engine) -> None:
        request = self.long_prompt(engine)
        belt: Belt[str] = Belt(4)
        base = engine.statistics().tokens_stepped

        def started(b: Belt[str]) -> bool:
            if isinstance(engine, WorkerEngine):
                # The worker's counters come with its releases: the admission (its
                # prefill starts with the next step) and a moment into it, then.
                admitted = b.trace.admitted
                return admitted is not None and time.monotonic() - admitted > _INTO_PREFILL_S
            return engine.statistics().tokens_stepped - base >= engine.n_batch

        def consume(b: Belt[str]) -> None:
            # Cancel once the first prompt chunk is evaluated: the prefill is under way.
            deadline = time.monotonic() + 120
            while not started(b):
                if time.monotonic() > deadline:
                    raise _StepFailed("cancel_prefill", "the prefill never started", "run again")
                time.sleep(0.001)
            b.cancel(EndReason.USER_CANCEL)

        _run(engine, request, belt, consume, "cancel_prefill")
        r = self.report
        r.prefill_prompt_tokens = belt.trace.prompt_tokens
        r.cancel_prefill_landed = "prefill" if belt.trace.first_token is None else "decode"
        r.cancel_release_prefill_ms = _ms(belt.trace.cancel_to_release)

    def cancel_decode(self, engine: _Engine, after: int = 8) -> None:
        request = GenerationRequest(
            prompt=_COUNTING, sampling=SamplingParams(max_tokens=256, temperature=0.0)
        )
        belt: Belt[str] = Belt(4)
        seen = 0

        def consume(b: Belt[str]) -> None:
            nonlocal seen
            for _piece in b:
                seen += 1
                if seen >= after:
                    b.cancel(EndReason.USER_CANCEL)
                    return

        _run(engine, request, belt, consume, "cancel_decode")
        if belt.end_reason is not EndReason.USER_CANCEL:
            raise _StepFailed(
                "cancel_decode",
                f"the reply ended ({belt.end_reason}) after {seen} tokens, before the cancel",
                "run it again",
            )
        self.report.cancel_release_decode_ms = _ms(belt.trace.cancel_to_release)


def _timed(report: ProbeReport, step: str, hint: str, work: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        return work()
    except _StepFailed:
        raise
    except TokenbeltError as exc:
        raise _StepFailed(step, exc, hint) from exc
    except Exception as exc:  # a native or unexpected failure is reported like any other
        raise _StepFailed(step, f"{type(exc).__name__}: {exc}", hint) from exc
    finally:
        report.steps_ms[step] = round((time.monotonic() - start) * 1000, 1)


def _resolve_hint(exc: BaseException) -> str:
    if isinstance(exc, UnknownModel):
        return "see the known aliases with `tokenbelt models list`"
    if isinstance(exc, CatalogError):
        return "fix or remove the catalog file named in the error"
    if isinstance(exc, DownloadError):
        return "check the network, then `tokenbelt models pull ALIAS`"
    return "check the alias and --device"


def run_probe(
    alias: str | None = None,
    *,
    device: str | None = None,
    load_timeout: float | None = 120.0,
    n_threads: int | None = None,
    n_threads_batch: int | None = None,
    isolation: str = "thread",
    home: Home | None = None,
    catalog: Catalog | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    timeouts: DownloadTimeouts | None = None,
    info: DeviceInfo | None = None,
) -> ProbeReport:
    """Run every step on ``alias`` (the default model if None); never raises a
    ``TokenbeltError``: a failure is in the report (``ok``, ``failed_step``, ``hint``).

    Blocks for the whole run (seconds for the default model, plus any download).
    """
    report = ProbeReport(alias=alias or DEFAULT_ALIAS, isolation=isolation)
    home = home or Home.from_env()
    cache = ModelCache(home)
    engine: _Engine | None = None
    try:
        try:
            cat = catalog if catalog is not None else Catalog.load(home)
            info = info or detect_device()
            choice = choose_variant(cat, report.alias or "", device=device, info=info, cache=cache)
            path = cache.fetch(choice.variant, progress=progress, cancel=cancel, timeouts=timeouts)
        except TokenbeltError as exc:
            raise _StepFailed("resolve", exc, _resolve_hint(exc)) from exc
        except Exception as exc:  # an unreadable cache or device: reported, not raised
            error = f"{type(exc).__name__}: {exc}"
            raise _StepFailed("resolve", error, _resolve_hint(exc)) from exc
        report.alias, report.variant = choice.entry.alias, choice.variant.id
        report.device, report.device_reason = choice.device, choice.reason
        report.model_path, report.context_length = str(path), choice.entry.context_length
        fix = cache.fix_hint(choice.variant)
        report.hashed = _timed(
            report, "verify", fix, lambda: cache.verify(choice.variant, path, cancel=cancel)
        )
        report.verified = True

        import llama_cpp  # noqa: F401  (the library's own RSS is not the model's)

        rss_before = _rss()
        start = time.monotonic()
        n_gpu_layers = 0 if choice.device == "cpu" else -1
        engine = _timed(
            report,
            "load",
            "raise --load-timeout, or check that this llama.cpp supports the model",
            lambda: (WorkerEngine if isolation == "process" else BatchEngine).load(
                path,
                load_timeout=load_timeout,
                n_ctx=min(4096, choice.entry.context_length),
                n_gpu_layers=n_gpu_layers,
                name=choice.variant.id,
                slots=1,
                n_threads=n_threads,
                n_threads_batch=n_threads_batch,
            ),
        )
        report.load_s = round(time.monotonic() - start, 3)
        probe = _Probe(report)
        engine_hint = "llama.cpp failed on this model: try another variant or report the error"
        assert engine is not None
        loaded = engine
        _timed(report, "stream", engine_hint, lambda: probe.stream(loaded))
        report.threads = loaded.threads
        _timed(report, "draft", engine_hint, lambda: probe.draft(loaded))
        _timed(report, "cancel_prefill", engine_hint, lambda: probe.cancel_prefill(loaded))
        _timed(report, "cancel_decode", engine_hint, lambda: probe.cancel_decode(loaded))
        rss_loaded = _rss()
        worker = loaded.worker_statistics() if isinstance(loaded, WorkerEngine) else None
        _timed(report, "unload", engine_hint, loaded.close)
        if worker is not None:
            after = loaded.worker_statistics() if isinstance(loaded, WorkerEngine) else None
            if worker.rss_bytes is not None:
                report.worker_rss_loaded_mb = round(worker.rss_bytes / MIB, 1)
            if after is not None:  # no worker process any more: all of its memory is back
                report.worker_rss_after_unload_mb = round((after.rss_bytes or 0) / MIB, 1)
        engine = None
        rss_after = _rss()
        report.rss_before_load_mb = round(rss_before / MIB, 1)
        report.rss_loaded_mb = round(rss_loaded / MIB, 1)
        report.rss_after_unload_mb = round(rss_after / MIB, 1)
        report.unload_rss_returned_mb = round((rss_loaded - rss_after) / MIB, 1)
        report.unload_rss_residual_mb = round((rss_after - rss_before) / MIB, 1)
        report.ok = True
    except _StepFailed as failed:
        report.ok = False
        report.failed_step, report.error, report.hint = failed.step, failed.error, failed.hint
        if isinstance(failed.__cause__, LoadTimeout):
            report.hint = "raise --load-timeout (the model took longer to load)"
        if isinstance(failed.__cause__, IntegrityError):
            report.verified = False
    finally:
        if engine is not None:
            engine.close()
    return report
