"""``POST /api/pull``: fetch and verify a model on a thread, reporting as Ollama does.

A catalog alias (or variant id), or a Hub file: ``hf://ORG/REPO/FILE.gguf`` as
``tokenbelt models pull`` takes it, or Ollama's ``hf.co/ORG/REPO[:QUANT]``. The lines are
Ollama's: ``pulling manifest``, ``pulling <digest>`` with ``total`` and ``completed``
bytes, ``verifying sha256 digest``, then ``success`` (or ``error``).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio

from ..._errors import ModelError, TokenbeltError
from ...models import ModelCache, Variant, hub_uri, pull_from_hub

#: how long one wait for news lasts before the reader looks again (a safety net)
_WAIT_S = 1.0


class Pull:
    """One pull on its own thread (``_run``), reported as lines a reader takes.

    Every phase's first line is kept for the reader; progress within the download
    replaces the progress line not yet read, so a fast download never queues lines
    for a slow reader (at most one line per phase waits).
    """

    def __init__(self, name: str) -> None:
        self.cancel = threading.Event()
        self.error: TokenbeltError | None = None
        self._cond = threading.Condition()
        self._pending: list[dict[str, Any]] = [{"status": "pulling manifest"}]
        self._done = False
        self.thread = threading.Thread(target=self._run, name=f"tokenbelt-pull-{name}", daemon=True)

    def _run(self) -> None:  # pragma: no cover - each kind of pull writes its own
        raise NotImplementedError

    def _add(self, line: dict[str, Any], *, done: bool = False) -> None:
        with self._cond:
            pending = self._pending
            if pending and "completed" in line and "completed" in pending[-1]:
                pending[-1] = line
            else:
                pending.append(line)
            self._done = done
            self._cond.notify_all()

    def start(self) -> None:
        self.thread.start()

    def _fail(self, exc: Exception) -> None:
        if isinstance(exc, TokenbeltError):
            self.error = exc
        else:  # a file system failure: report it, never crash the server
            self.error = ModelError(f"{type(exc).__name__}: {exc}")
        self._add({"error": str(self.error)}, done=True)

    def stop(self) -> None:
        """Cancel the download (an http(s) one resumes on the next pull); wake the reader."""
        self.cancel.set()
        with self._cond:
            self._cond.notify_all()

    def _take(self) -> tuple[list[dict[str, Any]], bool]:
        """Block until there are lines to read (or the pull was stopped); take them."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self.cancel.is_set(), timeout=_WAIT_S)
            lines, self._pending = self._pending, []
            return lines, self._done

    async def lines(self) -> AsyncIterator[object]:
        """The lines of the pull as they come; ends after ``success`` or ``error``."""
        while True:
            lines, done = await anyio.to_thread.run_sync(self._take)
            for line in lines:
                yield line
            if done or self.cancel.is_set():
                return


class CatalogPull(Pull):
    """A pull of a catalog variant: fetch its file, then verify it."""

    def __init__(self, cache: ModelCache, variant: Variant) -> None:
        super().__init__(variant.id)
        self.cache = cache
        self.variant = variant

    def _progress(self, completed: int, total: int | None) -> None:
        v = self.variant
        self._add(
            {
                "status": f"pulling {v.sha256[:12]}",
                "digest": f"sha256:{v.sha256}",
                "total": total or v.size,
                "completed": completed,
            }
        )

    def _run(self) -> None:
        v = self.variant
        try:
            self._progress(0, v.size)
            path = self.cache.fetch(v, progress=self._progress, cancel=self.cancel)
            self._progress(v.size, v.size)  # a file already here reports no progress of its own
            self._add({"status": "verifying sha256 digest"})
            self.cache.verify(v, path, cancel=self.cancel)
        except Exception as exc:
            self._fail(exc)
        else:
            self._add({"status": "success"}, done=True)


class HubPull(Pull):
    """A pull of a Hub file (``hf://ORG/REPO/FILE.gguf``, or Ollama's
    ``hf.co/ORG/REPO[:QUANT]``), registered under an alias as ``tokenbelt models pull
    hf://...`` does; the last line names the alias (``tokenbelt.alias``)."""

    def __init__(self, name: str) -> None:
        super().__init__("hub")
        self.name = name

    def _hub_progress(self, completed: int, total: int | None) -> None:
        self._add({"status": f"pulling {self.name}", "total": total or 0, "completed": completed})

    def _run(self) -> None:
        try:
            uri = hub_uri(self.name)
            self._add({"status": f"pulling {uri}"})
            pulled = pull_from_hub(
                uri, replace=True, progress=self._hub_progress, cancel=self.cancel
            )
        except Exception as exc:
            self._fail(exc)
        else:
            self._add({"status": "success", "tokenbelt": {"alias": pulled.entry.alias}}, done=True)
