"""Copies of the embedded default model in other precisions, made once and kept (not shipped).

``f32``: every weight in f32 (513 MiB, about this machine's last-level cache), made by
llama.cpp's own quantizer (``llama_model_quantize``, ``LLAMA_FTYPE_ALL_F32`` with
``allow_requantize``) from the Q4_1 file, in seconds. A step of a few rows costs little
more than a step of one on it (the weights are read once for all rows), which is the
regime of a GPU or of a large model on a laptop: where drafting pays most.

Kept in ``~/.cache/tokenbelt/bench/`` (``TOKENBELT_BENCH_CACHE`` to move it). The f16
copy the vLLM comparison serves is ``tests/engines/remote/vllm_cpu.py``'s ``ensure_f16``.

Run: ``.venv/bin/python benchmarks/model_copies.py f32`` (prints the path)
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32"}


def home() -> Path:
    default = Path.home() / ".cache" / "tokenbelt" / "bench"
    return Path(os.environ.get("TOKENBELT_BENCH_CACHE", default))


def copy_of_default(precision: str) -> Path:
    """The default model in ``precision`` (``FTYPES``), made first if need be."""
    import llama_cpp

    from tokenbelt.models import default_model_path

    source = default_model_path()
    out = home() / f"{source.stem.split('.')[0].lower()}-{precision}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[precision])
    params.allow_requantize = True
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if code != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed ({code}) making {out}")
    os.replace(partial, out)  # whole or absent
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in FTYPES:
        raise SystemExit(f"usage: model_copies.py {{{','.join(FTYPES)}}}")
    print(copy_of_default(sys.argv[1]))
