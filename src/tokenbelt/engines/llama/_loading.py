"""Loading a model under a deadline, and GGUF sanity checks before any native call."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from ..._errors import LoadTimeout, ModelLoadError

logger = logging.getLogger("tokenbelt.engines")

T = TypeVar("T")
E = TypeVar("E", bound="_Closable")


class _Closable(Protocol):
    def close(self) -> None: ...


GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: str | Path) -> Path:
    """Fail with ``ModelLoadError`` unless ``path`` is a readable file with the GGUF magic.

    A zero-filled or truncated download fails here with a clear message instead of
    deep inside the native loader.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {p}")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {p}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{p} is not a GGUF model file (it starts with {magic!r}); "
            "it may be corrupt or a partial download: remove it and pull again"
        )
    return p


def load_with_deadline(
    load: Callable[[], T],
    timeout: float | None,
    *,
    what: str,
    on_late: Callable[[T], None] | None = None,
) -> T:
    """Run ``load()`` on a worker thread and wait at most ``timeout`` seconds.

    Native loading cannot be interrupted, so on timeout this raises ``LoadTimeout``
    at once and leaves the worker to finish; whatever it loads late is handed to
    ``on_late`` (to free it) instead of leaking.
    """
    if timeout is None:
        return load()
    box: dict[str, object] = {}
    done = threading.Event()
    abandoned = threading.Event()
    lock = threading.Lock()

    def worker() -> None:
        try:
            box["value"] = load()
        except BaseException as exc:
            box["error"] = exc
        with lock:
            done.set()
            late = abandoned.is_set()
        if late and "value" in box and on_late is not None:
            logger.info("%s finished loading after its deadline; freeing it", what)
            on_late(box["value"])  # type: ignore[arg-type]

    thread = threading.Thread(target=worker, name=f"tokenbelt-load-{what}", daemon=True)
    thread.start()
    done.wait(timeout)
    with lock:
        if not done.is_set():
            abandoned.set()
            raise LoadTimeout(f"loading {what} took longer than {timeout:g} s")
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def load_gguf(make: Callable[[], E], model_path: str | Path, load_timeout: float | None) -> E:
    """Check the GGUF file, then build an engine with ``make`` under ``load_timeout``
    seconds; raises ``LoadTimeout`` or ``ModelLoadError``. An engine that finishes
    loading after the deadline is closed."""
    check_gguf_file(model_path)
    return load_with_deadline(
        make, load_timeout, what=Path(model_path).name, on_late=lambda engine: engine.close()
    )
