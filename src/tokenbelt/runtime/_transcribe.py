"""Transcription requests as the SDK hands them out, and a speech model's load.

``TranscriptionCalls`` is ``Model``'s speech surface: ``transcription(audio)`` decodes
the audio (a path, bytes or a file object) before anything queues, so a file that is
not audio, or too long, is an ``InvalidArgument`` naming ``file``; the request then takes
the model's admission queue and slot like a chat request, and its
``TranscriptionStream`` yields each ``Segment`` as the model decodes it. A stop
(``cancel()``, ``close()``, a ``break``, a cancelled task, a deadline) reaches the worker
at once and lands before its next native call (one 30 s window at most).
``load_speech`` is ``Runtime.load`` for a speech alias or folder.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._errors import Cancelled, EndOfStream, IllegalState, InvalidArgument
from ..belt import Belt, EndReason, Limits, Trace
from ..engines import (
    Segment,
    SpeechConfig,
    SpeechInfo,
    Transcribes,
    TranscriptionRequest,
    build,
    decode_audio,
)
from ..models import resolve_speech
from ._memory import OVERHEAD_BYTES, MemoryUse
from ._stream import OnBelt
from ._surface import EngineCalls

if TYPE_CHECKING:
    from ._model import Model
    from ._runtime import Runtime

#: what a transcription may take as audio: a path, the file's bytes, or a binary file
AudioInput = str | os.PathLike[str] | bytes | bytearray | memoryview | BinaryIO
#: the longest audio one request may hold unless the caller allows more
DEFAULT_MAX_AUDIO_SECONDS = 30 * 60.0
#: what CTranslate2, PyAV and the worker's interpreter take beside the weights
SPEECH_RUNTIME_BYTES = 192 << 20


def audio_bytes(audio: AudioInput) -> bytes:
    """The whole audio file as bytes, from a path, bytes or a binary file object."""
    if isinstance(audio, bytes | bytearray | memoryview):
        return bytes(audio)
    if isinstance(audio, str | os.PathLike):
        path = Path(audio)
        if not path.is_file():
            raise InvalidArgument(f"no audio file {str(path)!r}", param="file")
        return path.read_bytes()
    if hasattr(audio, "read"):
        data = audio.read()
        if isinstance(data, bytes):
            return data
    raise InvalidArgument(
        f"audio must be a path, bytes or a binary file, got {type(audio).__name__}",
        param="file",
    )


@dataclass(frozen=True)
class Transcription:
    """A finished transcription: its text, segments (times in seconds), the audio's
    length and language, its trace and end reason."""

    text: str
    segments: tuple[Segment, ...]
    language: str
    duration: float
    trace: Trace
    end_reason: EndReason

    @property
    def words(self) -> list[Any]:
        """Every word with its times (asked with ``word_timestamps=True``)."""
        return [w for s in self.segments for w in s.words]


class TranscriptionStream(OnBelt[Segment]):
    """The segments of one transcription as the model decodes them.

    Iterating (``for`` / ``async for``) yields ``Segment``\\ s in order; reading applies
    backpressure (the worker waits for room before its next window). Leaving early,
    ``close()`` or ``cancel()`` stops the request (``user_cancel``); the release follows
    once the worker's native call in flight (one window at most) ends.
    """

    def __init__(self, belt: Belt[Segment], request: TranscriptionRequest) -> None:
        super().__init__(belt)
        self.duration = request.seconds
        self.language = request.language or "en"
        self._segments: list[Segment] = []

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments read so far."""
        return tuple(self._segments)

    def __iter__(self) -> Iterator[Segment]:
        reader = iter(self._belt)
        try:
            for segment in reader:
                self._segments.append(segment)
                yield segment
        finally:
            reader.close()

    async def __aiter__(self) -> AsyncIterator[Segment]:
        try:
            while True:
                try:
                    segment = await self._belt.aget()
                except EndOfStream:
                    return
                self._segments.append(segment)
                yield segment
        finally:
            if self._belt.end_reason is None:
                self._belt.close()

    def read(self) -> Transcription:
        """Every segment (blocking); ``Cancelled`` if the request did not finish."""
        self._drain()
        return self.result()

    async def aread(self) -> Transcription:
        """Async ``read()``; a cancelled task cancels the request too."""
        await self._adrain()
        return self.result()

    def result(self) -> Transcription:
        """The transcription read, once the request ended ``stop``."""
        reason = self._belt.end_reason
        if reason is None:
            raise IllegalState("the request has not ended yet; read it first")
        if reason is not EndReason.STOP:
            raise Cancelled(reason)
        text = "".join(s.text for s in self._segments).strip()
        return Transcription(text, self.segments, self.language, self.duration, self.trace, reason)


def check_options(
    info: SpeechInfo, language: str | None, prompt: str | None, temperature: float, task: str
) -> None:
    """Refuse what the model cannot do, naming the parameter (``InvalidArgument``)."""
    if task not in ("transcribe", "translate"):
        raise InvalidArgument(f"task must be transcribe or translate, got {task!r}", param="task")
    if task == "translate" and not info.translates:
        raise InvalidArgument(
            f"model {info.name} is English-only: it transcribes English speech and cannot "
            "translate; ask for a transcription, or load a multilingual Whisper model",
            param="model",
        )
    if language is not None:
        if not isinstance(language, str) or not language:
            raise InvalidArgument("language must be an ISO 639-1 code", param="language")
        if info.languages and language not in info.languages:
            raise InvalidArgument(
                f"model {info.name} transcribes {', '.join(info.languages)} only, not {language!r}",
                param="language",
            )
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidArgument("prompt must be a string", param="prompt")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= 1
    ):
        raise InvalidArgument(
            f"temperature must be between 0 and 1, got {temperature!r}", param="temperature"
        )


class TranscriptionCalls(EngineCalls):
    """The speech surface of ``Model``: ``transcription``, ``transcribe``, ``atranscribe``."""

    def speech_info(self) -> SpeechInfo:
        """What the speech model can do; ``InvalidArgument`` for a model without speech."""
        return self._on_engine(lambda engine: self._speech(engine).speech_info())

    def _speech(self, engine: Any) -> Transcribes:
        if not isinstance(engine, Transcribes):
            raise InvalidArgument(
                f"model {self.name} is not a speech model: it cannot transcribe audio",
                param="model",
            )
        return engine

    def transcription(
        self,
        audio: AudioInput,
        *,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        word_timestamps: bool = False,
        task: str = "transcribe",
        max_seconds: float | None = DEFAULT_MAX_AUDIO_SECONDS,
        limits: Limits | None = None,
        request_id: str | None = None,
    ) -> TranscriptionStream:
        """Decode ``audio``, queue its transcription, and return its stream at once.

        Blocks while the audio decodes (in memory; about a tenth of a second for a
        minute) and while the model loads. ``InvalidArgument`` names ``file`` for audio
        that cannot be decoded or lasts more than ``max_seconds``, ``language``,
        ``temperature`` or ``model`` (``task="translate"`` on an English-only model).
        The deadlines count from the queueing (``first_token``: the first segment).
        """
        # Decoded before the model is asked for: bad audio never loads or queues anything.
        samples = decode_audio(audio_bytes(audio), max_seconds=max_seconds)

        def prepare(engine: Any) -> tuple[TranscriptionRequest, int]:
            check_options(self._speech(engine).speech_info(), language, prompt, temperature, task)
            request = TranscriptionRequest(
                samples,
                language=language,
                prompt=prompt,
                temperature=float(temperature),
                word_timestamps=word_timestamps,
                task=task,
            )
            return request, 0

        def open_stream(request: TranscriptionRequest, belt: Belt[Any]) -> TranscriptionStream:
            belt.trace.kind = "transcribe"
            belt.trace.audio_seconds = round(request.seconds, 3)
            return TranscriptionStream(belt, request)

        return self._queue(prepare, open_stream, limits, None, request_id)

    def transcribe(self, audio: AudioInput, **options: Any) -> Transcription:
        """Blocking ``transcription(...).read()``: the whole text, segments and trace.
        ``Cancelled`` when it ended early; a ``KeyboardInterrupt`` while waiting stops it."""
        return self.transcription(audio, **options).read()

    async def atranscribe(self, audio: AudioInput, **options: Any) -> Transcription:
        """Async ``transcribe``: decoding and queueing run off the event loop; a cancelled
        task stops the request."""
        import asyncio

        stream = await asyncio.to_thread(self.transcription, audio, **options)
        return await stream.aread()


def load_speech(
    runtime: Runtime,
    alias: str,
    *,
    pin: bool = False,
    lazy: bool = False,
    load_timeout: float | None = None,
    **options: Any,
) -> Model:
    """``Runtime.load`` for a speech model: resolve and verify its folder, count it in the
    memory budget, start its worker. One slot (the worker decodes one audio at a time);
    ``options`` are the model's own (``keep_alive``, ``queue_size``, ``limits``)."""
    options.pop("slots", None)
    options.pop("n_ctx", None)
    options.pop("device", None)
    options.pop("progress", None)
    name = Path(alias).name if Path(alias).is_dir() else alias
    info: dict[str, Any] = {"kind": "speech", "slots": 1, "isolation": "process"}

    def factory() -> list[Any]:
        resolved = resolve_speech(alias)
        info.update(
            alias=resolved.alias,
            path=str(resolved.path),
            verified=resolved.verified,
            languages=list(resolved.languages),
            translates=resolved.translates,
        )
        need = MemoryUse(
            weights=resolved.weights_bytes,
            kv=0,
            cache=0,
            overhead=OVERHEAD_BYTES + SPEECH_RUNTIME_BYTES,
        )
        info["memory_estimate"] = need.parts()
        config = SpeechConfig(
            name=name, languages=resolved.languages, translates=resolved.translates
        )
        with runtime.budget.lock:
            runtime.budget.make_room(name, need, runtime.models.values())
            return [build(resolved.path, config, load_timeout=load_timeout)]

    model = runtime._register(
        name,
        lambda: runtime._model(name, factory, info=info, load=False, pinned=pin, **options),
    )
    if not lazy:
        try:
            model.ensure_loaded()
        except BaseException:
            if not model.loads:
                runtime._forget(name, model)
            raise
    return model
