"""The in-process backend of ``tokenbelt chat``: the runtime loads the model here.

A turn is a ``Stream`` of the ``ChatSession``; its cancel is the stream's own, and its
figures come from the stream's trace once the engine released the request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..belt import EndReason
from ..runtime import ChatSession, Model, Runtime, Stream
from ._chat_backend import RELEASE_WAIT_S, TurnError, TurnSummary, set_system_prompt
from ._common import missing_model_file, startup_line


class LocalTurn:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[str]:
        return iter(self.stream)

    def cancel(self) -> None:
        self.stream.cancel(EndReason.USER_CANCEL)

    def summary(self) -> TurnSummary:
        self.stream.wait_released(RELEASE_WAIT_S)
        return TurnSummary.from_trace(self.stream.trace.to_dict())


class LocalBackend:
    """The runtime in this process; the session keeps the conversation."""

    def __init__(
        self,
        runtime: Runtime,
        model: Model,
        session: ChatSession,
        console: Console,
        sampling: dict[str, Any],
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.session = session
        self.console = console
        self.sampling = sampling
        #: the latest turn's stream
        self.last: Stream | None = None

    def start(self, text: str) -> LocalTurn:
        stream = self.session.stream(text)
        self.last = stream
        return LocalTurn(stream)

    def clear(self) -> None:
        self.session.messages[:] = [m for m in self.session.messages if m["role"] == "system"]

    def undo(self) -> bool:
        return bool(self.session.undo())

    def set_system(self, text: str | None) -> None:
        set_system_prompt(self.session.messages, text)

    def switch(self, name: str) -> str:
        missing = missing_model_file(name)
        if missing is not None:
            raise TurnError(f"file not found: {missing}")
        if Runtime.name_for(name) == self.model.name:
            return f"already using {self.model.name}"
        model = _load_with_progress(self.runtime, name, self.console)
        session = model.chat(**self.sampling)
        session.messages[:] = self.session.messages
        old, self.model, self.session = self.model, model, session
        self.runtime.unload(old.name)
        return _loaded_line(model, self.runtime)

    def close(self) -> None:
        self.runtime.close()


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _load_with_progress(runtime: Runtime, alias: str, console: Console) -> Model:
    """Load ``alias`` (or a .gguf path) with a spinner, elapsed time and download progress."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"loading {alias}", total=None, detail="")

        def on_progress(received: int, total: int | None) -> None:
            detail = _mb(received) + (f" / {_mb(total)}" if total else "")
            progress.update(task, description=f"downloading {alias}", detail=detail)
            if total and received >= total:
                progress.update(task, description=f"loading {alias}", detail="")

        return runtime.load(alias, progress=on_progress)


def _loaded_line(model: Model, runtime: Runtime) -> str:
    return f"loaded in {model.info.get('load_s', '?')} s: {startup_line(model, runtime)}"


def load_local(
    alias: str,
    console: Console,
    *,
    system: str | None,
    threads: int | None = None,
    threads_batch: int | None = None,
    isolation: str = "thread",
    stop_grace: float = 3.0,
    **sampling: Any,
) -> LocalBackend:
    """Load ``alias`` and start a session on it; prints the startup line."""
    runtime = Runtime(
        keep_alive=None,
        n_threads=threads,
        n_threads_batch=threads_batch,
        isolation=isolation,
        stop_grace=stop_grace,
    )
    try:
        model = _load_with_progress(runtime, alias, console)
        session = model.chat(system=system, **sampling)
    except BaseException:
        runtime.close()
        raise
    console.print(_loaded_line(model, runtime), style="dim", markup=False)
    return LocalBackend(runtime, model, session, console, sampling)
