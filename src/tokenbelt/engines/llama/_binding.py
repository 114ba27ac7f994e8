"""The llama.cpp binding as every llama.cpp engine imports it.

``quiet_native_logs`` routes llama.cpp's own log lines to ``logging`` (and closes the
files the binding opens at import); ``flag_abort_callback`` is the native abort hook
that lets a stop land inside a running ``llama_decode``: it reads a one-byte flag the
engine sets, without Python or the GIL; ``model_params`` are llama.cpp's model defaults
with the one change this machine's CPU backend needs (``amx_safe``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

_LOG_CALLBACK: Any = None
logger = logging.getLogger(__name__)


def quiet_native_logs() -> None:
    """Route llama.cpp's own log lines to ``logging`` (debug) instead of stderr."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return
    import llama_cpp

    native = logging.getLogger("tokenbelt.engines.llama.native")

    def forward(level: int, text: bytes, _data: object) -> None:
        if native.isEnabledFor(logging.DEBUG):
            native.debug("%s", text.decode("utf-8", "replace").rstrip())

    _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    # The binding opens two /dev/null files at import and never closes them, which
    # Python reports as unclosed at exit; close them then.
    from llama_cpp import _utils

    for name in ("outnull_file", "errnull_file"):
        handle = getattr(_utils, name, None)
        if handle is not None:
            atexit.register(handle.close)


def flag_abort_callback() -> Any:
    """An abort hook that reads a one-byte flag without Python or the GIL.

    llama.cpp calls the hook between graph nodes with our ``data`` pointer and
    aborts when it returns true. ``strlen`` on a two-byte buffer returns 1 when the
    first byte is set and 0 otherwise: a native, lock-free flag check. Where libc
    is not at hand, a Python callback does the same job, with the GIL.
    """
    import llama_cpp

    try:
        strlen = ctypes.CDLL(None).strlen
        address = ctypes.cast(strlen, ctypes.c_void_p).value or 0
        return llama_cpp.ggml_abort_callback(address)
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return llama_cpp.ggml_abort_callback(
            lambda data: bool(ctypes.cast(data, ctypes.POINTER(ctypes.c_char))[0] != b"\0")
        )


@functools.cache
def cpu_has_amx() -> bool:
    """Whether llama.cpp's CPU backend was built for, and runs on, a CPU with AMX."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def model_params() -> Any:
    """llama.cpp's default model parameters, with weight repacking into its extra
    buffer types off where the CPU backend has AMX.

    At the llama.cpp commit tokenbelt runs (0c1e57098), a CPU with AMX (Sapphire Rapids
    and later, and a build with ``GGML_NATIVE``, pip's default) repacks Q4_0/Q4_1/Q8_0/K
    weights for its AMX kernel, and that kernel segfaults on the first batch of two or
    more tokens: every prompt (llama.cpp #20824, closed without a fix). The plain CPU
    kernels run the same weights instead; elsewhere nothing changes.
    """
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    if cpu_has_amx():
        _say_amx_once()
        params.use_extra_bufts = False
    return params


@functools.cache
def _say_amx_once() -> None:
    logger.info(
        "this CPU has AMX: llama.cpp's AMX kernel crashes on prompts at this commit "
        "(llama.cpp #20824), so weights stay in the plain CPU layout"
    )


_DEFAULTS_SWAP = threading.Lock()


@contextlib.contextmanager
def amx_safe() -> Iterator[None]:
    """While it lasts, llama-cpp-python's ``Llama`` loads with ``model_params()``.

    ``Llama`` takes no model parameters of its own: it starts from the binding's
    defaults and loads inside its constructor, so the defaults it reads are swapped
    for the constructor's run (under a lock: one load at a time swaps them).
    """
    if not cpu_has_amx():
        yield
        return
    import llama_cpp.llama_cpp as binding  # the module ``Llama`` reads its defaults from

    with _DEFAULTS_SWAP:
        default = binding.llama_model_default_params
        setattr(binding, "llama_model_default_params", model_params)  # noqa: B010
        try:
            yield
        finally:
            setattr(binding, "llama_model_default_params", default)  # noqa: B010
