"""The SDK's speech surface on the real Whisper tiny.en: ``transcribe`` / ``atranscribe``
of a path, bytes or a file; ``transcription`` streamed segment by segment; a ``break``
stops the worker (trace: ``user_cancel``, released); what a speech model cannot do, and
what a chat model cannot do, is one clear error naming the parameter.

One runtime for the module (the speech model beside the embedded chat model, under a
memory budget that counts both), the clips spoken once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import speech
from tokenbelt import Cancelled, EndReason, InvalidArgument, Limits, Runtime, WorkerCrashed
from tokenbelt.models import default_model_path

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("speech")
    return {
        "short": speech.speak(speech.SHORT, folder / "short.wav"),
        "minute": speech.speak(" ".join(speech.MINUTE), folder / "minute.wav"),
    }


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    with Runtime(keep_alive=None, memory_budget=4 << 30) as rt:
        rt.load(str(default_model_path()))
        rt.load("whisper-tiny-en")
        yield rt


def test_a_path_bytes_and_a_file_give_the_words(runtime: Runtime, clips: dict[str, Path]) -> None:
    model = runtime.get("whisper-tiny-en")
    by_path = model.transcribe(clips["short"], word_timestamps=True)
    assert speech.word_match(by_path.text, speech.SHORT) >= speech.WORD_MATCH, by_path.text
    assert by_path.end_reason is EndReason.STOP
    assert by_path.trace.kind == "transcribe"
    assert by_path.trace.audio_seconds == pytest.approx(by_path.duration, abs=0.01)
    assert by_path.trace.real_time_factor is not None
    assert by_path.words
    assert [w.start for w in by_path.words] == sorted(w.start for w in by_path.words)
    by_bytes = model.transcribe(clips["short"].read_bytes())
    assert by_bytes.text == by_path.text
    with clips["short"].open("rb") as f:
        by_file = asyncio.run(model.atranscribe(f))
    assert by_file.text == by_path.text


def test_the_memory_budget_counts_the_speech_model(runtime: Runtime) -> None:
    use = runtime.get("whisper-tiny-en").memory()
    assert use is not None
    assert use.weights > 70 << 20
    assert runtime.get("whisper-tiny-en").info["verified"] is True


def test_a_break_stops_the_worker_and_releases_the_model(
    runtime: Runtime, clips: dict[str, Path]
) -> None:
    model = runtime.get("whisper-tiny-en")
    stream = model.transcription(clips["minute"])
    for segment in stream:
        assert segment.text
        break
    assert stream.wait_released(30)
    assert stream.end_reason is EndReason.USER_CANCEL
    assert stream.trace.completion_tokens < len(speech.MINUTE)
    assert model.statistics().running == 0
    with pytest.raises(Cancelled):
        stream.result()
    # The worker serves the next one at once.
    assert speech.word_match(model.transcribe(clips["short"]).text, speech.SHORT) >= 0.6


def test_async_segments_stream_and_a_deadline_ends_the_rest(
    runtime: Runtime, clips: dict[str, Path]
) -> None:
    model = runtime.get("whisper-tiny-en")

    async def read() -> list[str]:
        stream = await asyncio.to_thread(
            model.transcription, clips["minute"], limits=Limits(total=1.0)
        )
        got = [s.text async for s in stream]
        await stream.await_released(30)
        assert stream.end_reason is EndReason.TOTAL_TIMEOUT
        return got

    texts = asyncio.run(read())
    assert len(texts) < len(speech.MINUTE)


def test_what_a_model_cannot_do_names_the_parameter(
    runtime: Runtime, clips: dict[str, Path]
) -> None:
    whisper = runtime.get("whisper-tiny-en")
    for options, param in (
        ({"task": "translate"}, "model"),
        ({"language": "fr"}, "language"),
        ({"temperature": 3}, "temperature"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            whisper.transcribe(clips["short"], **options)
        assert caught.value.param == param
    with pytest.raises(InvalidArgument) as caught:
        whisper.transcribe(b"not audio" * 50)
    assert caught.value.param == "file"
    with pytest.raises(InvalidArgument, match="speech model") as caught:
        whisper.complete("hello")
    assert caught.value.param == "model"
    chat = next(m for name, m in runtime.models.items() if name != "whisper-tiny-en")
    with pytest.raises(InvalidArgument, match="not a speech model") as caught:
        chat.transcribe(clips["short"])
    assert caught.value.param == "model"


def test_a_crashed_worker_fails_its_request_and_the_next_one_is_served(
    clips: dict[str, Path],
) -> None:
    # A runtime of its own: the restarted worker's threads end with it.
    with Runtime(keep_alive=None) as own:
        model = own.load("whisper-tiny-en")
        stream = model.transcription(clips["minute"])
        pid = stream.trace.worker["pid"] if stream.trace.worker else None
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed):
            stream.read()
        assert stream.end_reason is EndReason.RUNTIME_ERROR
        assert stream.wait_released(30)
        # Queued at once: it waits for the worker that is starting again, then runs there.
        again = model.transcribe(clips["short"])
        assert speech.word_match(again.text, speech.SHORT) >= speech.WORD_MATCH
        assert again.trace.worker is not None
        assert again.trace.worker["pid"] != pid
