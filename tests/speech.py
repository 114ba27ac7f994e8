"""Real speech for the speech tests: espeak-ng says known sentences, PyAV re-encodes them.

Debian's ``espeak-ng`` (``scripts/setup dev`` installs it) writes 22 kHz WAV; ``encode``
turns those samples into MP3, FLAC, Ogg Opus or WebM Opus in memory, as a browser's
MediaRecorder or a phone would send them. ``word_match`` is the loose bound every test
states: the share of the sentence's words found in the transcript (espeak's voice is
robotic and tiny.en is the smallest Whisper, so a few words come out wrong).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

#: what a transcript of a clip must hold at least: this share of the sentence's words
WORD_MATCH = 0.6

SHORT = "The museum opens at ten in the morning and closes at six in the evening."
#: about a minute of speech, no sentence twice (a repeated one trips Whisper's fallback)
MINUTE = [
    "The museum opens at ten in the morning and closes at six in the evening.",
    "My brother bought a green bicycle from the shop near the station.",
    "Please remember to water the plants on the balcony every second day.",
    "The train to the coast leaves from platform four in twenty minutes.",
    "Our neighbours painted their front door bright yellow last summer.",
    "She reads a chapter of her favourite novel before going to sleep.",
    "The river flooded the lower fields after three days of heavy rain.",
    "We need two kilograms of flour, six eggs and a bottle of milk.",
    "The children built a small wooden boat and sailed it on the lake.",
    "His grandmother grew tomatoes, beans and pumpkins in the garden.",
    "The meeting about the new library was moved to Thursday afternoon.",
    "A flock of geese flew south over the hills at sunset.",
    "The baker wakes up at four o'clock to prepare fresh bread.",
    "Turn left at the church, then walk straight until you reach the bridge.",
    "The old clock in the hall stopped working during the storm.",
    "Engineers tested the new engine for many hours before the launch.",
]


def need_espeak() -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup dev installs it)")


def speak(text: str, path: Path) -> Path:
    """``text`` spoken by espeak-ng into the WAV file ``path``."""
    need_espeak()
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, timeout=60)
    return path


def samples(path: Path) -> tuple[np.ndarray, int]:
    """A 16-bit mono WAV file's samples (int16) and rate."""
    with wave.open(str(path)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16), w.getframerate()


def write_wav(data: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data.astype(np.int16).tobytes())
    return out.getvalue()


#: container -> (codec, sample rate) for ``encode``
CODECS = {
    "mp3": ("libmp3lame", 22050),
    "flac": ("flac", 22050),
    "ogg": ("libopus", 48000),
    "webm": ("libopus", 48000),
}


def encode(path: Path, container: str) -> bytes:
    """The WAV file at ``path`` re-encoded as ``container`` (``CODECS``), in memory."""
    import av

    from tokenbelt.engines import decode_audio

    codec, rate = CODECS[container]
    pcm = decode_audio(path.read_bytes())  # 16 kHz float32
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as box:
        stream = box.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(
            (pcm * 32767).astype(np.int16)[None, :], format="s16", layout="mono"
        )
        frame.sample_rate = 16000
        resampler = av.AudioResampler(format=stream.format, layout="mono", rate=rate)
        for piece in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(piece):
                box.mux(packet)
        for packet in stream.encode(None):
            box.mux(packet)
    return out.getvalue()


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def word_match(transcript: str, sentence: str) -> float:
    """The share of ``sentence``'s words that ``transcript`` holds (numbers as words are
    compared as digits too: Whisper writes "ten" as "10")."""
    digits = {
        "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
        "seven": "7", "eight": "8", "nine": "9", "ten": "10", "twenty": "20",
    }  # fmt: skip
    got = set(_words(transcript)) | set(re.findall(r"\d+", transcript))
    want = _words(sentence)
    found = sum(1 for w in want if w in got or digits.get(w) in got)
    return found / len(want)
