"""The speech worker process: faster-whisper (CTranslate2) on one model folder.

The parent (``_engine.SpeechEngine``) and this process speak over one pipe, in tuples:

    parent -> child   ("start", job, TranscriptionRequest)   ("go", job)
                      ("cancel", job)                        ("close",)
    child -> parent   ("ready", info_dict)   ("failed_load", message)
                      ("segment", job, Segment)   ("ended", job, "stop" | "cancelled")
                      ("failed", job, message)

Where a stop lands: CTranslate2's Whisper ``generate`` has no per-token callback (4.x:
neither a callback nor an abort flag), so the smallest unit a stop can reach is one
native call: one window's encode, or one window's decode (Whisper's window is 30 s of
audio). ``_Gate`` wraps the model so that every ``encode``, ``generate``,
``detect_language`` and ``align`` call first checks the request's stop flag, which a
reader thread sets the moment a ``cancel`` arrives: a stop waits for the native call
in flight and no more (measured by ``benchmarks/transcription.py``). Backpressure: after
each segment the decode waits for the parent's ``go`` (the belt had room) or a cancel.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from ..._defaults import DEFAULT_DECODE_NICE
from ._request import Segment, TranscriptionRequest, Word


class _Stopped(Exception):
    """The request was cancelled: raised at the next native call."""


class _Gate:
    """The CTranslate2 model, with the stop flag checked before each native call."""

    def __init__(self, model: Any, stop: threading.Event) -> None:
        self._model = model
        self._stop = stop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if name not in ("encode", "generate", "detect_language", "align"):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            if self._stop.is_set():
                raise _Stopped
            return attr(*args, **kwargs)

        return checked


class _Job:
    def __init__(self, job: int, request: TranscriptionRequest) -> None:
        self.id = job
        self.request = request
        self.stop = threading.Event()
        self.go = threading.Event()


def _segment(seg: Any) -> Segment:
    words = tuple(
        Word(w.word, round(float(w.start), 3), round(float(w.end), 3), float(w.probability))
        for w in (seg.words or ())
    )
    return Segment(
        id=int(seg.id) - 1,
        start=round(float(seg.start), 3),
        end=round(float(seg.end), 3),
        text=str(seg.text),
        words=words,
        tokens=tuple(int(t) for t in seg.tokens),
        temperature=float(seg.temperature or 0.0),
        avg_logprob=float(seg.avg_logprob),
        compression_ratio=float(seg.compression_ratio),
        no_speech_prob=float(seg.no_speech_prob),
    )


def _run(conn: Connection, send: threading.Lock, model: Any, ct2: Any, job: _Job) -> None:
    request = job.request
    model.model = _Gate(ct2, job.stop)
    temperatures: Any = (
        [0.0, 0.2, 0.4, 0.6, 0.8, 1.0] if request.temperature == 0 else request.temperature
    )
    status = "stop"
    try:
        segments, _info = model.transcribe(
            request.audio,
            language=request.language,
            task=request.task,
            initial_prompt=request.prompt or None,
            temperature=temperatures,
            word_timestamps=request.word_timestamps,
            beam_size=1,
            vad_filter=False,
        )
        for seg in segments:
            with send:
                conn.send(("segment", job.id, _segment(seg)))
            job.go.wait()
            job.go.clear()
            if job.stop.is_set():
                raise _Stopped
    except _Stopped:
        status = "cancelled"
    except Exception as exc:  # the parent fails the request with it; the worker lives on
        with send:
            conn.send(("failed", job.id, f"{type(exc).__name__}: {exc}"))
        return
    with send:
        conn.send(("ended", job.id, status))


def main(conn: Connection, path: str, threads: int) -> None:
    """The worker's entry point: load, say ``ready``, then serve jobs one at a time."""
    if sys.platform == "linux" and DEFAULT_DECODE_NICE:
        # As nice as a chat engine's decode threads (CTranslate2's threads, made later,
        # inherit it): beside a chat the two share the cores, as embeddings beside chat
        # do, and the threads that deliver tokens and stops stay ahead of both.
        os.nice(DEFAULT_DECODE_NICE)
    try:
        from faster_whisper import WhisperModel

        model = WhisperModel(path, device="cpu", compute_type="int8", cpu_threads=threads)
    except Exception as exc:
        conn.send(("failed_load", f"{type(exc).__name__}: {exc}"))
        return
    ct2 = model.model
    conn.send(
        (
            "ready",
            {"multilingual": bool(ct2.is_multilingual), "threads": threads},
        )
    )
    send = threading.Lock()
    # The parent starts one job at a time (one slot): two places are the close's too.
    jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=2)
    current: dict[int, _Job] = {}

    def read() -> None:
        # The pipe's one reader: a cancel sets the job's flag at once, whatever runs.
        with contextlib.suppress(EOFError, OSError):
            while True:
                msg = conn.recv()
                if msg[0] == "close":
                    break
                if msg[0] == "start":
                    job = _Job(msg[1], msg[2])
                    current[job.id] = job
                    jobs.put(job)
                elif (job_ := current.get(msg[1])) is not None:
                    if msg[0] == "cancel":
                        job_.stop.set()
                    job_.go.set()  # a cancel wakes a decode waiting for its credit too
        for job_ in list(current.values()):  # the parent is gone or closing: stop
            job_.stop.set()
            job_.go.set()
        jobs.put(None)

    threading.Thread(target=read, name="tokenbelt-speech-reader", daemon=True).start()
    while (job := jobs.get()) is not None:
        try:
            _run(conn, send, model, ct2, job)
        except (BrokenPipeError, OSError):
            return
        finally:
            current.pop(job.id, None)
        model.model = ct2


if __name__ == "__main__":
    import os
    import socket
    import sys

    _sock = socket.socket(fileno=int(sys.argv[1]))
    main(Connection(_sock.detach()), sys.argv[2], int(sys.argv[3]))
    os._exit(0)  # CTranslate2's threads need no orderly teardown
