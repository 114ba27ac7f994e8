"""The llama.cpp binding as every llama.cpp engine imports it.

``quiet_native_logs`` routes llama.cpp's own log lines to ``logging`` (and closes the
files the binding opens at import); ``flag_abort_callback`` is the native abort hook
that lets a stop land inside a running ``llama_decode``: it reads a one-byte flag the
engine sets, without Python or the GIL.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
from typing import Any

_LOG_CALLBACK: Any = None


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
