"""A speech-to-text engine: Whisper models through faster-whisper (CTranslate2), in a
worker process (``_engine.SpeechEngine``, ``_child``), audio decoded with PyAV
(``_audio``), segments on the belt (``_request``)."""

from ._audio import FORMATS, AudioTooLong, decode_audio
from ._engine import DEFAULT_SPEECH_STOP_GRACE, SpeechConfig, SpeechEngine
from ._request import (
    SAMPLE_RATE,
    TASKS,
    Segment,
    SpeechInfo,
    Transcribes,
    TranscriptionRequest,
    Word,
)

__all__ = [
    "DEFAULT_SPEECH_STOP_GRACE",
    "FORMATS",
    "SAMPLE_RATE",
    "TASKS",
    "AudioTooLong",
    "Segment",
    "SpeechConfig",
    "SpeechEngine",
    "SpeechInfo",
    "Transcribes",
    "TranscriptionRequest",
    "Word",
    "decode_audio",
]
