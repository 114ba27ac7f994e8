"""The request path of a transcription, shared by every dialect that serves one.

Like a generation: the request id, the caller's ownership, the ``api`` label of its
metrics, its deadlines, the bounded queue (429 when full), ``/v1/requests`` and its
cancel, and the race against the client's disconnect (``client_disconnect``, which
reaches the speech worker at once). A whole answer is all or nothing: a request that
ended for any reason but ``stop`` is an error naming its exact end reason (504 for a
deadline, 503 for a shutdown, 409 for a cancel), never part of a transcript. A streamed
one sends each segment's text as it is decoded and always ends with a terminal event
(``done`` or ``error``, then ``[DONE]``).

The uploaded file is read into memory and decoded there; starlette may spool a part
over 1 MiB to a temporary file, which is created unlinked (nothing on disk outlives the
request, not even a crash) and closed before the request queues.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

from ..._errors import InvalidArgument
from ...runtime import Model, Transcription, TranscriptionStream
from ._embed import answer_job, submit_embedding
from ._errors import ErrorShape
from ._options import TokenbeltOptions
from ._path import Asgi, RequestPath
from ._responses import EventStreamResponse, disconnect, reader_gone

#: names OpenAI's clients send for a transcription model: they get the served speech model
OPENAI_SPEECH_NAMES = frozenset(
    {"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-transcribe-diarize"}
)


def speech_model_for(path: RequestPath, name: str) -> Model:
    """The speech model a request names: a loaded model by its name, or for ``""`` and
    OpenAI's own names (``whisper-1``...) the one speech model served. A model that is
    not a speech model is refused where it is used (400, ``model``)."""
    models = path.state.runtime.models
    if name and name in models:
        return models[name]
    if not name or name in OPENAI_SPEECH_NAMES:
        speech = [m for m in models.values() if m.info.get("kind") == "speech"]
        if speech:
            return speech[0]
        raise InvalidArgument(
            "no speech model is served here; start the server with one "
            "beside the chat model (tokenbelt serve smollm2-135m whisper-tiny-en)",
            param="model",
        )
    return path.state.model_for(name)


async def submit_transcription(
    path: RequestPath,
    make: Callable[..., TranscriptionStream],
    options: TokenbeltOptions | None,
    model: Model,
    *,
    api: str,
) -> TranscriptionStream:
    """Queue a transcription: ``make(limits=..., request_id=...)`` is the model's
    ``transcription`` with the audio bound. Blocks (off the event loop) to decode the
    audio and to reload the model."""
    return await submit_embedding(path, model, make, options, api=api)


def answer_transcription(
    stream: TranscriptionStream,
    render: Callable[[Transcription], Response],
    *,
    shape: ErrorShape,
) -> Response:
    """The answer once the whole transcript is in and the worker let go (raced against
    the client's disconnect, which stops the request ``client_disconnect``)."""
    return answer_job(
        stream,
        render,
        shape=shape,
        failed="transcription failed",
        ended="the transcription ended with",
    )


def stream_transcription(
    path: RequestPath,
    stream: TranscriptionStream,
    events: Callable[[TranscriptionStream], AsyncIterator[object]],
) -> Response:
    """A streamed transcription: ``events(stream)`` yields the dialect's events (ending
    with its terminal ones); a disconnect or a reader that accepts nothing stops it."""
    settings = path.state.settings
    every = settings.keepalive_s
    return Asgi(
        EventStreamResponse(
            disconnect(stream),  # type: ignore[arg-type]
            events(stream),
            {"x-request-id": stream.request_id},
            reader_timeout=settings.reader_timeout,
            gone=reader_gone(stream),  # type: ignore[arg-type]
            keepalive=(every, b": keepalive\n\n") if every else None,
        )
    )
