"""Audio bytes to the samples a speech model takes, with PyAV (FFmpeg's libraries).

Whatever FFmpeg reads is taken: WAV, MP3, FLAC, Ogg (Vorbis, Opus), WebM (Opus, as a
browser's ``MediaRecorder`` writes it), M4A/MP4 (AAC). Decoding happens in memory
(nothing is written to disk) and before the request queues, so a file that is not
audio, holds none, or is longer than allowed is one clear ``InvalidArgument`` naming
``file``, and the model's process never sees it.
"""

from __future__ import annotations

import io
from typing import Any

from ..._errors import InvalidArgument, ModelLoadError
from ._request import SAMPLE_RATE

#: the formats the tests prove (FFmpeg reads many more)
FORMATS = ("wav", "mp3", "flac", "ogg", "webm")


class AudioTooLong(InvalidArgument):
    """The audio lasts longer than the server or call allows."""


def _probe_seconds(data: bytes) -> float | None:
    """The container's stated duration, read from its header alone (None: not stated)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise InvalidArgument("file holds no audio stream", param="file")
        if container.duration is not None and container.duration > 0:
            return float(container.duration) / 1_000_000
        stream = container.streams.audio[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
    return None


def decode_audio(data: bytes, *, max_seconds: float | None = None) -> Any:
    """``data`` (a whole audio file) as 16 kHz mono float32 samples (a numpy array).

    Raises ``InvalidArgument`` (``param="file"``) for empty bytes, bytes FFmpeg cannot
    read as audio, and audio without samples; ``AudioTooLong`` when it lasts more than
    ``max_seconds`` (checked from the header first where it says, so a long file is
    refused before it is decoded).
    """
    try:
        import av
        from faster_whisper.audio import decode_audio as decode
    except ImportError as exc:
        raise ModelLoadError(
            f"speech to text needs faster-whisper and PyAV ({exc}): pip install 'tokenbelt[speech]'"
        ) from exc
    if not data:
        raise InvalidArgument("file is empty: send an audio file", param="file")
    try:
        stated = _probe_seconds(data)
        if max_seconds is not None and stated is not None and stated > max_seconds + 1:
            _too_long(stated, max_seconds)
        samples = decode(io.BytesIO(data), sampling_rate=SAMPLE_RATE)
    except InvalidArgument:
        raise
    except (av.FFmpegError, ValueError, IndexError, StopIteration, EOFError) as exc:
        raise InvalidArgument(
            f"file could not be decoded as audio ({type(exc).__name__}: {exc}); "
            f"send WAV, MP3, FLAC, Ogg or WebM audio",
            param="file",
        ) from exc
    if len(samples) == 0:
        raise InvalidArgument("file holds no audio samples", param="file")
    seconds = len(samples) / SAMPLE_RATE
    if max_seconds is not None and seconds > max_seconds:
        _too_long(seconds, max_seconds)
    return samples


def _too_long(seconds: float, limit: float) -> None:
    raise AudioTooLong(
        f"file holds {seconds:.1f} s of audio; this server transcribes at most {limit:g} s "
        "per request",
        param="file",
    )
