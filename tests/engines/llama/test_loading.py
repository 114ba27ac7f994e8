"""Loading a model: file checks before any native call, and the load deadline."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import LoadTimeout, ModelLoadError
from tokenbelt.engines import (
    LlamaEngine,
    amx_safe,
    check_gguf_file,
    load_with_deadline,
    model_params,
)
from tokenbelt.models import default_model_path

NET = 30.0


# -- check_gguf_file ---------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError, match="model file not found") as info:
        check_gguf_file(path)
    assert str(path) in str(info.value)


def test_a_directory_is_not_a_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model file not found"):
        check_gguf_file(tmp_path)


def test_zero_filled_file(tmp_path: Path) -> None:
    path = tmp_path / "zeros.gguf"
    path.write_bytes(bytes(1024))
    with pytest.raises(ModelLoadError, match="is not a GGUF model file") as info:
        check_gguf_file(path)
    message = str(info.value)
    assert r"b'\x00\x00\x00\x00'" in message
    assert "partial download" in message


@pytest.mark.parametrize("content", [b"GGML" + bytes(60), b"<!DOCTYPE html>", b"GG", b""], ids=repr)
def test_wrong_magic(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="is not a GGUF model file"):
        check_gguf_file(path)


def test_good_magic_passes(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(16))
    assert check_gguf_file(str(path)) == path


def test_the_default_model_passes() -> None:
    assert check_gguf_file(default_model_path()) == default_model_path()


# -- load_with_deadline ------------------------------------------------------------------------


def test_no_timeout_loads_inline() -> None:
    caller = threading.current_thread()
    seen: list[threading.Thread] = []

    def load() -> str:
        seen.append(threading.current_thread())
        return "model"

    assert load_with_deadline(load, None, what="x") == "model"
    assert seen == [caller]


def test_loads_within_the_deadline() -> None:
    late: list[object] = []
    value = load_with_deadline(lambda: 42, NET, what="x", on_late=late.append)
    assert value == 42
    assert late == []


def test_the_loader_error_propagates() -> None:
    def load() -> object:
        raise ModelLoadError("broken file")

    with pytest.raises(ModelLoadError, match="broken file"):
        load_with_deadline(load, NET, what="x")


def test_timeout_raises_and_the_late_result_goes_to_on_late() -> None:
    proceed = threading.Event()
    handed: list[object] = []
    handed_over = threading.Event()
    result = object()

    def load() -> object:
        assert proceed.wait(NET)
        return result

    def on_late(value: object) -> None:
        handed.append(value)
        handed_over.set()

    with pytest.raises(LoadTimeout, match=r"loading big\.gguf took longer than 0\.05 s"):
        load_with_deadline(load, 0.05, what="big.gguf", on_late=on_late)
    assert handed == []  # still loading: nothing to hand over yet

    proceed.set()  # the native load finishes after its deadline
    assert handed_over.wait(NET)
    assert handed == [result]


def test_a_late_failure_is_not_handed_to_on_late() -> None:
    proceed = threading.Event()
    handed: list[object] = []

    def load() -> object:
        assert proceed.wait(NET)
        raise ModelLoadError("late and broken")

    with pytest.raises(LoadTimeout):
        load_with_deadline(load, 0.05, what="x", on_late=handed.append)
    proceed.set()
    for thread in threading.enumerate():
        if thread.name == "tokenbelt-load-x":
            thread.join(NET)
    assert handed == []


# -- LlamaEngine.load --------------------------------------------------------------------------


@pytest.fixture
def no_native_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if llama.cpp is asked to load anything."""
    import llama_cpp

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the native loader was called")

    monkeypatch.setattr(llama_cpp, "Llama", refuse)


@pytest.mark.usefixtures("no_native_load")
@pytest.mark.parametrize("load_timeout", [None, 30.0])
def test_engine_load_rejects_a_corrupt_file_before_native_code(
    tmp_path: Path, load_timeout: float | None
) -> None:
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(4096))
    before = set(threading.enumerate())
    with pytest.raises(ModelLoadError, match="is not a GGUF model file"):
        LlamaEngine.load(path, load_timeout=load_timeout)
    assert set(threading.enumerate()) <= before  # rejected on the caller's thread


@pytest.mark.usefixtures("no_native_load")
def test_engine_rejects_a_missing_file_before_native_code(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model file not found"):
        LlamaEngine(tmp_path / "nothing.gguf")


def test_a_truncated_gguf_fails_in_the_loader_with_model_load_error(tmp_path: Path) -> None:
    # The magic is right, the rest is not: llama.cpp itself refuses it, and its error
    # is translated at the engine boundary.
    path = tmp_path / "truncated.gguf"
    path.write_bytes(default_model_path().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match=r"llama\.cpp could not load") as info:
        LlamaEngine(path, n_ctx=256)
    assert isinstance(info.value.__cause__, ValueError | RuntimeError | OSError)


@pytest.mark.model
def test_engine_load_under_a_deadline() -> None:
    engine = LlamaEngine.load(default_model_path(), n_ctx=256, load_timeout=NET)
    try:
        assert engine.context_length == 256
        assert engine.name == "SmolLM2-135M-Instruct.Q4_1"
    finally:
        engine.close()
    engine.close()  # idempotent


@pytest.mark.model
def test_engine_load_timeout_frees_the_late_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[LlamaEngine] = []
    closed = threading.Event()
    real_init = LlamaEngine.__init__
    real_close = LlamaEngine.close

    def slow_init(self: LlamaEngine, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        loaded.append(self)
        assert released.wait(NET)  # the load outlives its deadline

    def close(self: LlamaEngine) -> None:
        real_close(self)
        closed.set()

    released = threading.Event()
    monkeypatch.setattr(LlamaEngine, "__init__", slow_init)
    monkeypatch.setattr(LlamaEngine, "close", close)
    with pytest.raises(LoadTimeout, match="SmolLM2"):
        LlamaEngine.load(default_model_path(), n_ctx=256, load_timeout=0.01)
    released.set()
    assert closed.wait(NET), "the engine that loaded late was not closed"
    assert len(loaded) == 1
    assert loaded[0]._closed


# -- AMX: llama.cpp's AMX kernel crashes on prompts at this commit ------------------------------


@pytest.mark.model
@pytest.mark.parametrize("amx", [True, False])
def test_weights_skip_the_amx_layout_only_on_a_cpu_with_amx(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both engines' loads (the batch engine's own parameters, and ``Llama`` inside
    ``amx_safe``) turn weight repacking off exactly where the CPU backend has AMX,
    and the binding's own defaults are left as they were."""
    import llama_cpp
    import llama_cpp.llama_cpp as binding

    from tokenbelt.engines.llama import _binding

    monkeypatch.setattr(_binding, "cpu_has_amx", lambda: amx)
    assert model_params().use_extra_bufts is (not amx)
    with amx_safe():
        llm = llama_cpp.Llama(str(default_model_path()), n_ctx=64, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is (not amx)
        assert llm.tokenize(b"one two three")  # loaded, and usable
    finally:
        llm.close()
    assert binding.llama_model_default_params().use_extra_bufts is True


@pytest.mark.model
def test_a_batch_of_many_tokens_decodes_on_this_cpu() -> None:
    """The crash it avoids: on a CPU with AMX, the first decode of two or more tokens
    (the batch engine's warm-up at load is one) segfaulted the process. Checked in a
    child, so that a crash fails this test alone."""
    script = (
        "from tokenbelt.engines import BatchEngine;"
        "from tokenbelt.models import default_model_path;"
        "e = BatchEngine.load(default_model_path(), n_ctx=256, slots=1);"
        "e.close();"
        "print('loaded')"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=NET
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["loaded"]
