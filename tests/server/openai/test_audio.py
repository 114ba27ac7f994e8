"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` over real HTTP: real speech
(espeak-ng) through the real Whisper tiny.en, driven by the ``openai`` client and by
httpx's multipart (as curl sends it).

One server for the module, a chat model and the speech model side by side; the clips
are spoken once per module. A transcript must hold ``WORD_MATCH`` (60%) of its
sentence's words: espeak's voice is robotic and tiny.en the smallest Whisper.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import speech
from tokenbelt import EndReason
from tokenbelt.server import ServerSettings

from ..conftest import NET, Served, SharedServer, real_runtime, shared_server

pytestmark = pytest.mark.model

URL = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("speech")
    short = speech.speak(speech.SHORT, folder / "short.wav")
    minute = speech.speak(" ".join(speech.MINUTE), folder / "minute.wav")
    data, rate = speech.samples(minute)
    two = folder / "two-minutes.wav"
    two.write_bytes(speech.write_wav(speech.np.concatenate([data, data]), rate))
    return {"short": short, "minute": minute, "two": two}


def _runtime() -> Any:
    runtime = real_runtime()
    runtime.load("whisper-tiny-en")
    return runtime


@pytest.fixture(scope="module")
def shared(module_home: Path, clips: dict[str, Path]) -> Iterator[SharedServer]:
    settings = ServerSettings(max_audio_bytes=6 << 20, max_audio_seconds=90.0)
    with shared_server(_runtime, settings) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=NET) as c:
        yield c


def post(served: Served, data: bytes, name: str = "a.wav", **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{served.url}{URL}",
        files={"file": (name, data)},
        data={"model": "whisper-tiny-en", **fields},
        timeout=NET,
    )


def test_the_openai_client_gets_the_words_and_the_duration(
    client: openai.OpenAI, clips: dict[str, Path]
) -> None:
    with clips["short"].open("rb") as f:
        got = client.audio.transcriptions.create(model="whisper-1", file=f)
    assert speech.word_match(got.text, speech.SHORT) >= speech.WORD_MATCH, got.text
    assert got.usage is not None
    assert got.usage.type == "duration"
    assert 3 < got.usage.seconds < 8  # type: ignore[union-attr]


@pytest.mark.parametrize("fmt", ["text", "srt", "vtt"])
def test_each_text_format(client: openai.OpenAI, clips: dict[str, Path], fmt: str) -> None:
    with clips["short"].open("rb") as f:
        got: str = client.audio.transcriptions.create(  # type: ignore[call-overload]
            model="whisper-tiny-en", file=f, response_format=fmt
        )
    assert speech.word_match(got, speech.SHORT) >= speech.WORD_MATCH, got
    if fmt == "srt":
        assert got.startswith("1\n00:00:00,000 --> 00:00:0")
    if fmt == "vtt":
        assert got.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_verbose_json_has_segments_and_words_in_order(
    client: openai.OpenAI, clips: dict[str, Path]
) -> None:
    with clips["short"].open("rb") as f:
        got = client.audio.transcriptions.create(
            model="whisper-1",
            file=f,
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
        )
    assert got.language == "english"
    assert speech.word_match(got.text, speech.SHORT) >= speech.WORD_MATCH
    assert got.segments
    assert got.words
    starts = [w.start for w in got.words]
    assert starts == sorted(starts)
    assert got.words[-1].end <= got.duration + 0.5
    assert speech.word_match(" ".join(w.word for w in got.words), speech.SHORT) >= 0.6
    extra = got.model_extra or {}
    assert extra["tokenbelt"]["end_reason"] == "stop"
    trace = extra["tokenbelt"]["trace"]
    assert trace["kind"] == "transcribe"
    assert trace["audio_seconds"] == pytest.approx(got.duration, abs=0.01)
    assert trace["real_time_factor"] > 0


def test_streamed_deltas_add_up_to_the_done_text(
    client: openai.OpenAI, clips: dict[str, Path]
) -> None:
    with clips["short"].open("rb") as f:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=f, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done"
    assert kinds.count("transcript.text.done") == 1
    assert set(kinds[:-1]) == {"transcript.text.delta"}
    done = events[-1]
    assert "".join(e.delta for e in events[:-1]) == done.text  # type: ignore[union-attr]
    assert speech.word_match(done.text, speech.SHORT) >= speech.WORD_MATCH  # type: ignore[union-attr]


def test_curl_style_multipart_of_a_browser_recording(
    served: Served, clips: dict[str, Path]
) -> None:
    # WebM Opus, as MediaRecorder writes it; each other format's decoding is tested
    # without the model (tests/engines/speech/test_audio.py).
    got = post(served, speech.encode(clips["short"], "webm"), "a.webm")
    assert got.status_code == 200, got.text
    assert speech.word_match(got.json()["text"], speech.SHORT) >= speech.WORD_MATCH


def test_an_english_only_model_refuses_to_translate(
    client: openai.OpenAI, clips: dict[str, Path]
) -> None:
    with clips["short"].open("rb") as f, pytest.raises(openai.BadRequestError) as caught:
        client.audio.translations.create(model="whisper-1", file=f)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "model"
    assert "cannot translate" in error["message"]


def test_bad_audio_is_a_400_naming_file_and_the_model_goes_on(
    served: Served, clips: dict[str, Path]
) -> None:
    wav = clips["short"].read_bytes()
    corrupt = wav[:12] + b"\xff" * 64 + wav[76:]
    for data in (b"this is not audio at all" * 20, b"", corrupt, clips["two"].read_bytes()):
        got = post(served, data)
        assert got.status_code == 400, got.text
        assert got.json()["error"]["param"] == "file", got.text
    assert "at most 90 s" in got.json()["error"]["message"]
    got = post(served, wav)
    assert got.status_code == 200
    assert speech.word_match(got.json()["text"], speech.SHORT) >= speech.WORD_MATCH


def test_refusals_name_their_field(served: Served, clips: dict[str, Path]) -> None:
    wav = clips["short"].read_bytes()
    for fields, param in (
        ({"response_format": "mp3"}, "response_format"),
        ({"language": "de"}, "language"),
        ({"temperature": "hot"}, "temperature"),
        ({"include[]": "logprobs"}, "include[]"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
        ({"model": "smollm2-135m-instruct-q4_1"}, "model"),
    ):
        got = post(served, wav, **fields)
        assert got.status_code in (400, 404), got.text
        assert got.json()["error"]["param"] == param or got.status_code == 404, got.text
    big = httpx.post(
        f"{served.url}{URL}", files={"file": ("a.wav", b"\0" * (7 << 20))}, timeout=NET
    )
    assert big.status_code == 413
    page = httpx.post(
        f"{served.url}{URL}",
        files={"file": ("a.wav", wav)},
        headers={"origin": "https://elsewhere.example"},
        timeout=NET,
    )
    assert page.status_code == 403


def test_a_client_that_leaves_stops_the_worker_within_a_window(
    served: Served, clips: dict[str, Path]
) -> None:
    data = clips["minute"].read_bytes()
    with httpx.stream(
        "POST",
        f"{served.url}{URL}",
        files={"file": ("minute.wav", data)},
        data={"model": "whisper-1", "stream": "true"},
        timeout=NET,
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: ") and "transcript.text.delta" in line:
                break
    trace = served.recorder.by_id(request_id)
    served.assert_released(trace, EndReason.CLIENT_DISCONNECT)
    # Stopped, not run to the end: fewer segments than the minute's sentences.
    assert trace.completion_tokens < len(speech.MINUTE)
    assert trace.cancel_to_release is not None
    assert trace.cancel_to_release < NET  # a safety net; benchmarks/ measures it


def test_deadlines_end_a_transcription_with_their_reason(
    served: Served, clips: dict[str, Path]
) -> None:
    data = clips["minute"].read_bytes()
    got = post(served, data, tokenbelt=json.dumps({"first_token_timeout": 0.3}))
    assert got.status_code == 504, got.text
    assert got.json()["error"]["code"] == "first_token_timeout"
    served.assert_released(
        served.recorder.by_id(got.headers["x-request-id"]), EndReason.FIRST_TOKEN_TIMEOUT
    )
    with httpx.stream(
        "POST",
        f"{served.url}{URL}",
        files={"file": ("minute.wav", data)},
        data={"stream": "true", "tokenbelt": json.dumps({"total_timeout": 1.0})},
        timeout=NET,
    ) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
        request_id = response.headers["x-request-id"]
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "total_timeout"
    served.assert_released(served.recorder.by_id(request_id), EndReason.TOTAL_TIMEOUT)
