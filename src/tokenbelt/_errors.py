"""The one exception tree of tokenbelt.

Every error tokenbelt raises on purpose is a ``TokenbeltError``. Errors from the
engine binding, the network and the file system are translated at one boundary
each (``raise ... from exc``) so callers never need to catch a library's own types.

    TokenbeltError
    ├── InvalidArgument (also ValueError) ... a bad size, duration or sampling value
    ├── IllegalState ........................ a lifecycle transition that is not allowed
    ├── Cancelled ........................... raised inside a producer at a checkpoint
    ├── EndOfStream ......................... ``get()`` on a belt that has ended and is empty
    ├── EngineError
    │   ├── ModelLoadError .................. the model file could not be loaded
    │   ├── LoadTimeout ..................... loading took longer than ``load_timeout``
    │   ├── PromptTooLong ................... the prompt does not fit the context
    │   ├── DecodeError ..................... the engine failed while generating
    │   ├── WorkerCrashed ................... the engine's worker process died or was killed
    │   └── UpstreamError ................... a remote engine's upstream refused or failed
    │       └── UpstreamUnavailable ......... none could serve: refused, 5xx, reset, ejected
    ├── ModelError
    │   ├── UnknownModel .................... no catalog entry for an alias or variant
    │   ├── CatalogError .................... a catalog file is malformed
    │   ├── DownloadError ................... fetching a model file failed
    │   │   └── DownloadCancelled ........... the download was cancelled (resumable)
    │   └── IntegrityError .................. a file's size or sha256 is not what it should be
    ├── AdmissionError
    │   ├── QueueFull ....................... the admission queue is full (``rejected``)
    │   ├── ModelLoading .................... the model is still loading
    │   └── OverBudget ...................... the model does not fit the memory budget
    └── RuntimeClosed ....................... the runtime was closed
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .belt import EndReason


class TokenbeltError(Exception):
    """Base class of every error tokenbelt raises on purpose."""


class InvalidArgument(TokenbeltError, ValueError):
    """A value given to tokenbelt is out of range or of the wrong kind."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        #: the request parameter at fault, when one is (an HTTP error's ``param``)
        self.param = param


class IllegalState(TokenbeltError):
    """An operation is not allowed in the object's current lifecycle state."""


class Cancelled(TokenbeltError):
    """Raised at a producer's checkpoint once its belt has been cancelled.

    Producers let it propagate: the belt already knows the reason.
    """

    def __init__(self, reason: EndReason) -> None:
        super().__init__(f"cancelled: {reason.value}")
        self.reason = reason


class EndOfStream(TokenbeltError):
    """Raised by a belt's ``get()`` once the belt has ended and holds no more items."""

    def __init__(self, reason: EndReason) -> None:
        super().__init__(f"end of stream: {reason.value}")
        self.reason = reason


class EngineError(TokenbeltError):
    """The engine could not do what was asked."""


class ModelLoadError(EngineError):
    """A model file could not be loaded."""


class LoadTimeout(EngineError):
    """Loading a model took longer than its load deadline."""


class WorkerCrashed(EngineError):
    """The engine's worker process died (a signal, an exit) or was killed for a late stop.

    Every request it held ends ``runtime_error`` with this error; the message names the
    cause ("engine worker killed by signal 9 (SIGKILL)").
    """


class PromptTooLong(EngineError, ValueError):
    """The prompt (plus room for at least one token) does not fit the context window."""


class DecodeError(EngineError):
    """The engine failed while evaluating or sampling."""


class UpstreamError(EngineError):
    """An upstream server of a remote engine answered with an error, or broke off.

    ``status`` is the upstream's HTTP status when it answered with one (a 4xx is
    passed on to the client with its message), else None.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class UpstreamUnavailable(UpstreamError):
    """No upstream could serve the request: refused, 5xx, reset, or every one ejected.

    Retried on another upstream while no token has reached the client.
    """


class ModelError(TokenbeltError):
    """A problem finding, fetching or verifying a model."""


class UnknownModel(ModelError, LookupError):
    """No catalog entry matches the requested alias or variant."""


class CatalogError(ModelError):
    """A catalog file is malformed."""


class DownloadError(ModelError):
    """Fetching a model file failed."""


class DownloadCancelled(DownloadError):
    """A download was cancelled; its partial file is kept for resuming."""


class IntegrityError(ModelError):
    """A model file's size or sha256 does not match the catalog."""


class AdmissionError(TokenbeltError):
    """A request was not admitted."""


class QueueFull(AdmissionError):
    """The admission queue is full; the request ends as ``rejected``."""


class ModelLoading(AdmissionError):
    """The model is still loading; try again shortly."""


class OverBudget(AdmissionError):
    """Loading the model would pass the memory budget. ``transient``: models that are
    busy now hold what is missing (try again later); else it can never fit, or only
    pinned models stand in its way."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class RuntimeClosed(TokenbeltError):
    """The runtime (or the model) has been closed."""
