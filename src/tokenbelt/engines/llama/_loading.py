"""Loading a model under a deadline, and GGUF sanity checks before any native call."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..._errors import InvalidArgument, LoadTimeout, ModelLoadError
from ._binding import model_params
from ._config import FLASH_ATTN, KV_TYPES, LlamaConfig

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


def open_context(
    lib: Any,
    path: Path,
    config: LlamaConfig,
    *,
    n_cells: int,
    n_batch: int,
    n_seq_max: int,
    threads: tuple[int, int],
) -> tuple[Any, Any]:
    """Load the weights and make a decode context of ``n_cells`` KV cells for a batch
    engine: (model, context). Raises ``InvalidArgument`` for an ``n_ctx`` past what the
    model was trained on (unless ``force_n_ctx``), ``ModelLoadError`` when llama.cpp
    cannot load it."""
    from llama_cpp import _internals

    try:
        mparams = model_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        # verbose=True: not more output (llama.cpp's log lines are routed to logging),
        # but no swapping of the process's stdout and stderr for /dev/null while
        # loading, which swallowed every other thread's output meanwhile (a load
        # abandoned at its deadline kept them swapped while the CLI printed why).
        model = _internals.LlamaModel(path_model=str(path), params=mparams, verbose=True)
        trained = int(lib.llama_model_n_ctx_train(model.model))
        if config.n_ctx > trained and not config.force_n_ctx:
            model.close()  # type: ignore[no-untyped-call]
            raise InvalidArgument(
                f"n_ctx {config.n_ctx} is more than {path.name} was trained on ({trained} "
                "tokens): past it the model's replies degrade; give n_ctx <= "
                f"{trained}, or force it (--force-n-ctx, force_n_ctx=True)"
            )
        cparams = lib.llama_context_default_params()
        # Cells for the running sequences only: prefix-cache entries are held in
        # memory (``_prefix.py``), and a saved set is read back one entry at a time.
        cparams.n_ctx = n_cells
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch  # one ubatch per step: an abort drops it whole
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = True  # shared prefixes take their cells once
        # Flash attention as llama.cpp's own server has it ("auto": on where the device
        # has it, the CPU included). Without it every step computes attention over every
        # cell up to the highest one in use; the CPU kernel skips the cells a sequence
        # cannot see. Measured here (2 threads, 400-token replies, the cache filling):
        # 53 -> 33 tok/s off, 69 -> 52 on. A q8_0 cache needs it on: llama.cpp
        # quantizes V only inside it.
        cparams.type_k = cparams.type_v = KV_TYPES[config.kv_type]
        flash = "on" if config.kv_type != "f16" else config.flash_attn
        cparams.flash_attn_type = FLASH_ATTN[flash]
        cparams.n_threads, cparams.n_threads_batch = threads
        ctx = _internals.LlamaContext(model=model, params=cparams, verbose=True)
    except InvalidArgument:
        raise
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc
    return model, ctx
