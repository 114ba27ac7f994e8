"""What a transcription asks and what goes on its belt.

A ``TranscriptionRequest`` holds audio already decoded to 16 kHz mono float32 samples
(decoded before it queues, so a file that is not audio, or too long, is refused up
front); each item the engine puts on its belt is a ``Segment``: the text of one span of
the audio with its times (and its words' times when asked), in order. The first
segment is the request's first result (its first-token deadline); the last is followed
by ``finish(stop)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: the sample rate every speech engine here takes (Whisper's)
SAMPLE_RATE = 16_000
#: what a request may ask the model to do with the speech
TASKS = ("transcribe", "translate")


@dataclass(frozen=True, slots=True)
class Word:
    """One word and its times in seconds from the start of the audio."""

    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True, slots=True)
class Segment:
    """One span of the audio and its text (times in seconds from the audio's start)."""

    id: int
    start: float
    end: float
    text: str
    words: tuple[Word, ...] = ()
    tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass(frozen=True, slots=True)
class TranscriptionRequest:
    """Transcribe ``audio`` (16 kHz mono float32 samples, a numpy array).

    ``language``: the speech's language (None: the model detects it, or its only one);
    ``prompt``: text the model continues from (names, spelling); ``temperature``: 0 is
    greedy, with Whisper's fallback to higher ones on a failed window;
    ``word_timestamps``: each segment's words with their times.
    """

    audio: Any
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    task: str = "transcribe"

    @property
    def seconds(self) -> float:
        """The audio's length in seconds."""
        return float(len(self.audio)) / SAMPLE_RATE


@dataclass(frozen=True, slots=True)
class SpeechInfo:
    """What a speech model can do."""

    #: the model's name (the catalog alias, or its folder's name)
    name: str
    #: the languages it transcribes (ISO 639-1 codes); one for an English-only model
    languages: tuple[str, ...]
    #: whether it can translate speech into English (an ``.en`` model cannot)
    translates: bool
    #: the audio one decode step covers: a stop waits for at most one such window
    window_seconds: float = 30.0
    #: extra facts for ``/v1/models`` and the status page
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Transcribes(Protocol):
    """An engine that serves ``TranscriptionRequest``\\ s."""

    def speech_info(self) -> SpeechInfo:
        """What the model can do (cheap, any thread)."""
        ...
