"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` (OpenAI).

A multipart form, as OpenAI's clients send it: ``file`` (the audio: WAV, MP3, FLAC, Ogg,
WebM...), ``model``, ``language``, ``prompt``, ``response_format`` (``json``, ``text``,
``srt``, ``vtt``, ``verbose_json``), ``temperature``, ``timestamp_granularities[]``
(``segment``, ``word``: with ``verbose_json``) and ``stream`` (server-sent
``transcript.text.delta`` events as each segment is decoded, then
``transcript.text.done``, then ``[DONE]``). tokenbelt's own ``tokenbelt`` field takes its
request options as JSON (deadlines). Any other field is a 400 naming it. A model that
cannot translate (an English-only one) answers a translation with a 400 saying so.
Ollama serves the same OpenAI route (it has no native ``/api`` audio route), so its
clients use this one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..._errors import InvalidArgument
from ...belt import EndReason
from ...runtime import Transcription, TranscriptionStream
from ..core import (
    RELEASE_WAIT_S,
    Serving,
    TokenbeltOptions,
    answer_transcription,
    openai_shape,
    speech_model_for,
    stream_transcription,
    submit_transcription,
    tokenbelt_final,
)

API = "openai"
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
FIELDS = frozenset(
    {
        "file",
        "model",
        "language",
        "prompt",
        "response_format",
        "temperature",
        "timestamp_granularities[]",
        "timestamp_granularities",
        "stream",
        "tokenbelt",
    }
)
#: the ISO 639-1 codes Whisper's tiny.en speaks, as verbose_json names them
LANGUAGE_NAMES = {"en": "english"}

router = APIRouter()


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(done: Transcription) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm`` times."""
    cues = [
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate(done.segments, 1)
    ]
    return "\n".join(cues)


def vtt(done: Transcription) -> str:
    """WebVTT: a header, then ``HH:MM:SS.mmm`` cues."""
    cues = [
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n"
        for s in done.segments
    ]
    return "WEBVTT\n\n" + "\n".join(cues)


class _Form:
    """The form's fields, checked: every error is a 400 naming its field."""

    def __init__(self, fields: dict[str, Any], grains: list[str]) -> None:
        unknown = sorted(set(fields) - FIELDS)
        if unknown:
            raise InvalidArgument(
                f"{unknown[0]} is not a field tokenbelt's audio routes take "
                f"(they take {', '.join(sorted(FIELDS))})",
                param=unknown[0],
            )
        self.model = self._text(fields, "model") or ""
        self.language = self._text(fields, "language") or None
        self.prompt = self._text(fields, "prompt") or None
        self.format = self._text(fields, "response_format") or "json"
        if self.format not in FORMATS:
            raise InvalidArgument(
                f"response_format must be one of {', '.join(FORMATS)}, got {self.format!r}",
                param="response_format",
            )
        temperature = self._text(fields, "temperature")
        try:
            self.temperature = float(temperature) if temperature else 0.0
        except ValueError:
            raise InvalidArgument(
                f"temperature must be a number, got {temperature!r}", param="temperature"
            ) from None
        stream = (self._text(fields, "stream") or "false").lower()
        if stream not in ("true", "false"):
            raise InvalidArgument(f"stream must be true or false, got {stream!r}", param="stream")
        self.stream = stream == "true"
        bad = [g for g in grains if g not in GRANULARITIES]
        if bad:
            raise InvalidArgument(
                f"timestamp_granularities[] takes segment and word, got {bad[0]!r}",
                param="timestamp_granularities[]",
            )
        if grains and self.format != "verbose_json":
            raise InvalidArgument(
                "timestamp_granularities[] needs response_format verbose_json",
                param="timestamp_granularities[]",
            )
        self.words = "word" in grains
        self.segments = not grains or "segment" in grains
        options = self._text(fields, "tokenbelt")
        try:
            self.options = TokenbeltOptions.model_validate_json(options) if options else None
        except ValidationError as exc:
            raise InvalidArgument(
                f"tokenbelt: {exc.errors()[0]['msg']}", param="tokenbelt"
            ) from None

    @staticmethod
    def _text(fields: dict[str, Any], name: str) -> str | None:
        value = fields.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise InvalidArgument(f"{name} must be a text field, not a file", param=name)
        return value


def _check_origin(request: Request, path: Serving) -> None:
    """Refuse a browser page of another site: a multipart POST is a CORS "simple
    request" (no preflight), so without this any page the user visits could make this
    machine transcribe. The server's own page and ``--cors-origin`` ones may."""
    origin = request.headers.get("origin")
    if origin is None or origin in path.state.settings.cors_origins:
        return
    if urlsplit(origin).netloc == request.headers.get("host", ""):
        return
    raise HTTPException(403, f"the audio routes take no uploads from pages of {origin}")


async def _read_form(request: Request) -> tuple[_Form, bytes]:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise InvalidArgument(
            "send the audio as multipart/form-data with a file field", param="file"
        )
    async with request.form(max_files=1, max_fields=32) as form:
        fields = {k: v for k, v in form.multi_items() if not k.startswith("timestamp_gran")}
        grains = [str(v) for k, v in form.multi_items() if k.startswith("timestamp_gran")]
        if "timestamp_granularities[]" in form or "timestamp_granularities" in form:
            fields["timestamp_granularities[]"] = ""
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidArgument("file is missing: send the audio in a file field", param="file")
        data = await upload.read()
        fields.pop("timestamp_granularities[]", None)
        return _Form(fields, grains), data


def _segment_json(s: Any) -> dict[str, Any]:
    return {
        "id": s.id,
        "seek": 0,
        "start": s.start,
        "end": s.end,
        "text": s.text,
        "tokens": list(s.tokens),
        "temperature": s.temperature,
        "avg_logprob": s.avg_logprob,
        "compression_ratio": s.compression_ratio,
        "no_speech_prob": s.no_speech_prob,
    }


def _render(form: _Form, task: str, stream: TranscriptionStream) -> Any:
    def render(done: Transcription) -> Response:
        if form.format == "text":
            return PlainTextResponse(done.text + "\n")
        if form.format == "srt":
            return PlainTextResponse(srt(done))
        if form.format == "vtt":
            return PlainTextResponse(vtt(done), media_type="text/vtt")
        usage = {"type": "duration", "seconds": round(done.duration, 3)}
        body: dict[str, Any] = {"text": done.text, "usage": usage}
        if form.format == "verbose_json":
            body = {
                "task": task,
                "language": LANGUAGE_NAMES.get(done.language, done.language),
                "duration": round(done.duration, 3),
                "text": done.text,
                "segments": [_segment_json(s) for s in done.segments] if form.segments else None,
                "usage": usage,
            }
            if form.words:
                body["words"] = [
                    {"word": w.word.strip(), "start": w.start, "end": w.end} for w in done.words
                ]
        body["tokenbelt"] = tokenbelt_final(stream)
        return JSONResponse(body)

    return render


async def _events(stream: TranscriptionStream) -> AsyncIterator[object]:
    """OpenAI's streaming transcription: a delta per decoded segment, then ``done``."""
    first = True
    async for segment in stream:
        text = segment.text.lstrip() if first else segment.text
        first = False
        yield {"type": "transcript.text.delta", "delta": text}
    await stream.await_released(RELEASE_WAIT_S)
    final = tokenbelt_final(stream)
    if stream.end_reason is EndReason.STOP:
        text = "".join(s.text for s in stream.segments).strip()
        usage = {"type": "duration", "seconds": round(stream.duration, 3)}
        yield {"type": "transcript.text.done", "text": text, "usage": usage, "tokenbelt": final}
    else:
        reason = stream.end_reason or EndReason.RUNTIME_ERROR
        yield {
            "type": "error",
            "error": {
                "message": f"the transcription ended with {reason.value}",
                "type": "timeout" if reason.is_timeout else "cancelled",
                "code": reason.value,
            },
            "tokenbelt": final,
        }
    yield "[DONE]"


async def _serve(request: Request, path: Serving, task: str) -> Response:
    _check_origin(request, path)
    form, data = await _read_form(request)
    model = speech_model_for(path, form.model)
    max_seconds = path.state.settings.max_audio_seconds

    def make(**queue: Any) -> TranscriptionStream:
        return model.transcription(
            data,
            language=form.language,
            prompt=form.prompt,
            temperature=form.temperature,
            word_timestamps=form.words,
            task=task,
            max_seconds=max_seconds,
            **queue,
        )

    stream = await submit_transcription(path, make, form.options, model, api=API)
    if form.stream:
        return stream_transcription(path, stream, _events)
    return answer_transcription(stream, _render(form, task, stream), shape=openai_shape)


#: the form, for the OpenAPI document (the route reads it itself, to name a bad field)
FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "model": {"type": "string"},
                        "language": {"type": "string"},
                        "prompt": {"type": "string"},
                        "response_format": {"type": "string", "enum": list(FORMATS)},
                        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                        "timestamp_granularities[]": {
                            "type": "array",
                            "items": {"type": "string", "enum": list(GRANULARITIES)},
                        },
                        "stream": {"type": "boolean"},
                        "tokenbelt": {"type": "string", "description": "request options, JSON"},
                    },
                }
            }
        },
    }
}


@router.post(
    "/v1/audio/transcriptions",
    summary="Speech to text (OpenAI), whole or streamed",
    openapi_extra=FORM,
)
async def transcriptions(request: Request, path: Serving) -> Response:
    return await _serve(request, path, "transcribe")


@router.post(
    "/v1/audio/translations", summary="Speech to English text (OpenAI)", openapi_extra=FORM
)
async def translations(request: Request, path: Serving) -> Response:
    return await _serve(request, path, "translate")
