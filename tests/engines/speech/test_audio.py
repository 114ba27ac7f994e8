"""Audio decoding before a transcription queues (no model): each format a client sends
decodes to the same 16 kHz samples, and each kind of bad file is one clear error naming
``file``."""

from __future__ import annotations

from pathlib import Path

import pytest

import speech
from tokenbelt import InvalidArgument
from tokenbelt.engines import AudioTooLong, decode_audio


@pytest.fixture(scope="module")
def wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return speech.speak(speech.SHORT, tmp_path_factory.mktemp("speech") / "short.wav")


@pytest.mark.parametrize("container", ["mp3", "flac", "ogg", "webm"])
def test_each_format_decodes_to_the_same_length(wav: Path, container: str) -> None:
    expected = len(decode_audio(wav.read_bytes())) / 16000
    got = decode_audio(speech.encode(wav, container))
    assert got.dtype.name == "float32"
    assert len(got) / 16000 == pytest.approx(expected, abs=0.1)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "empty"),
        (b"plain text, not audio " * 20, "could not be decoded"),
        (b"\x89PNG\r\n\x1a\n" + b"0" * 200, "no audio"),
    ],
)
def test_bad_files_are_one_clear_error(data: bytes, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as caught:
        decode_audio(data)
    assert caught.value.param == "file"


def test_a_corrupt_header_and_a_lone_header_are_refused(wav: Path) -> None:
    data = wav.read_bytes()
    for bad in (data[:12] + b"\xff" * 64 + data[76:], data[:44]):
        with pytest.raises(InvalidArgument) as caught:
            decode_audio(bad)
        assert caught.value.param == "file"


def test_too_long_is_refused_with_the_limit(wav: Path) -> None:
    with pytest.raises(AudioTooLong, match="at most 2 s"):
        decode_audio(wav.read_bytes(), max_seconds=2)
