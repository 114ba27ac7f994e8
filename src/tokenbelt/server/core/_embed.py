"""The request path of embedding and rerank requests, shared by every dialect.

Like a generation: the request id the answer carries, the caller's ownership, the
``api`` label of its metrics, the request's deadlines, the bounded queue (429 when
full), ``/v1/requests`` and its cancel, and the race against the client's disconnect
(``client_disconnect``) all happen here. An embedding answer is all or nothing: a
request that ended for any reason but ``stop`` is answered with an error that names
its exact end reason (504 for a deadline, 503 for a shutdown, 409 for a cancel), never
with part of its vectors.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import orjson
from starlette.responses import JSONResponse, Response

from ..._errors import Cancelled, InvalidArgument, RuntimeClosed
from ...belt import EndReason, new_request_id
from ...runtime import Embeddings, EmbeddingStream, Model, TranscriptionStream
from ._errors import ErrorShape, compact_json, failure
from ._middleware import CALLER, REQUEST_ID
from ._options import TokenbeltOptions
from ._path import RELEASE_WAIT_S, Asgi, RequestPath, end_failure
from ._responses import DeferredResponse

#: what ``submit_embedding`` queues: an embedding or a transcription stream
S = TypeVar("S", bound=EmbeddingStream | TranscriptionStream)


async def submit_embedding(
    path: RequestPath,
    model: Model,
    make: Callable[..., S],
    options: TokenbeltOptions | None,
    *,
    api: str,
) -> S:
    """Queue an embedding, rerank or transcription request: ``make(limits=...,
    request_id=...)`` is the model's ``embeddings``, ``reranking`` or ``transcription``
    with the body's inputs bound. Blocks (off the event loop) to reload the model and to
    tokenize (or decode the audio)."""
    state = path.state
    if state.shutting_down:
        raise RuntimeClosed("the server is shutting down")
    request_id = state.request_id_from(REQUEST_ID.get()) or new_request_id()
    state.own(request_id, CALLER.get())
    state.metrics.label(request_id, api)
    try:
        stream = await anyio.to_thread.run_sync(
            partial(make, limits=state.limits_for(options, model), request_id=request_id)
        )
    except BaseException:
        state.metrics.forget(request_id)
        state.disown(request_id)
        raise
    state.track(stream)  # type: ignore[arg-type]
    return stream


def answer_embedding(
    stream: EmbeddingStream,
    render: Callable[[Embeddings], dict[str, Any]],
    *,
    shape: ErrorShape,
) -> Response:
    """The answer once every vector is in and the engine let go (raced against the
    client's disconnect, which stops the request ``client_disconnect``)."""
    return answer_job(
        stream,
        lambda done: VectorResponse(render(done)),
        shape=shape,
        failed="embedding failed",
        ended="the request ended with",
    )


def answer_job(
    stream: S,
    respond: Callable[[Any], Response],
    *,
    shape: ErrorShape,
    failed: str,
    ended: str,
) -> Response:
    """The answer to an embedding, rerank or transcription request once its result is
    in and the engine let go (raced against the client's disconnect, which stops the
    request ``client_disconnect``): ``respond(result)`` with the request id and trace
    headers, else the end's error (``failed``: the words before an engine's error;
    ``ended``: before an end reason)."""
    head = {"x-request-id": stream.request_id}

    def fail(status: int, message: str, type_: str, code: str, retry: bool) -> Response:
        return end_failure(stream, head, status, message, type_, code, retry=retry, shape=shape)

    async def compute() -> Any:
        try:
            done = await stream.aread()
        except Cancelled:
            done = None
        except Exception as exc:
            await stream.await_released(RELEASE_WAIT_S)
            status, type_, code = failure(exc)
            return fail(status, f"{failed}: {exc}", type_, code, True)
        await stream.await_released(RELEASE_WAIT_S)
        head["x-tokenbelt-trace"] = compact_json(stream.trace.to_dict())
        if done is None:
            reason = stream.end_reason or EndReason.RUNTIME_ERROR
            message = f"{ended} {reason.value}"
            if reason.is_timeout:
                return fail(504, message, "timeout", reason.value, False)
            if reason is EndReason.SHUTDOWN:
                return fail(503, message, "service_unavailable", "shutdown", False)
            return fail(409, message, "cancelled", reason.value, False)
        response = respond(done)
        response.headers.update(head)
        return response

    return Asgi(DeferredResponse(partial(stream.cancel, EndReason.CLIENT_DISCONNECT), compute))


class VectorResponse(JSONResponse):
    """JSON with vectors in it, written by orjson: a float32 vector (``encode_vector``) is
    written element by element in the shortest form that reads back as the same float32
    (``0.0123``, not ``0.012299999594688416``): half the bytes, and about 15x less of the
    event loop's time than ``json`` over a list of floats (0.016 against 0.23 ms for 576
    dimensions), which on a short input is most of what HTTP adds to the model's work."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def shrink(rows: Any, dimensions: int | None) -> Any:
    """Matryoshka truncation (``check_dimensions`` said yes): the first ``dimensions`` of
    each vector, renormalised to unit length."""
    if dimensions is None or dimensions == rows.shape[1]:
        return rows
    import numpy as np

    cut = np.ascontiguousarray(rows[:, :dimensions])
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.where(norms > 0, norms, 1.0)


def check_dimensions(model: Model, dimensions: int | None, param: str = "dimensions") -> None:
    """Refuse ``dimensions`` before anything queues unless the model's catalog entry lists
    it among the sizes the model was trained to be cut to (``matryoshka``)."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise InvalidArgument(f"{param} must be a positive integer", param=param)
    allowed: Sequence[int] = model.info.get("matryoshka") or ()
    if not allowed:
        raise InvalidArgument(
            f"{param}: model {model.name} was not trained for Matryoshka truncation; "
            "leave dimensions out",
            param=param,
        )
    if dimensions not in allowed:
        sizes = ", ".join(str(d) for d in allowed)
        raise InvalidArgument(f"{param}: model {model.name} may be cut to {sizes}", param=param)


def encode_vector(row: Any, encoding: str) -> Any:
    """One vector as OpenAI sends it: base64 of little-endian float32, or (``float``) a
    contiguous float32 array, its non-finite values as 0.0, for ``VectorResponse`` to
    write as JSON numbers."""
    import numpy as np

    if encoding == "base64":
        return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode("ascii")
    finite = np.nan_to_num(np.asarray(row, dtype=np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    return np.ascontiguousarray(finite)
