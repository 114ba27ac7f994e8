"""The memory budget's choices, the GGUF estimate it starts from, and single-flight loads."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenbelt import ModelLoadError, ModelState, OverBudget, Runtime, ScriptedEngine
from tokenbelt.models import default_model_path
from tokenbelt.runtime import MemoryBudget, MemoryUse, estimate
from tokenbelt.runtime._memory import OVERHEAD_BYTES, gguf_metadata

MIB = 1 << 20


def use(mib: int) -> MemoryUse:
    return MemoryUse(weights=mib * MIB - OVERHEAD_BYTES, kv=0, cache=0)


@dataclass
class Fake:
    name: str
    mib: int
    last_used: float
    keep_alive: float | None = 300.0
    pinned: bool = False
    is_busy: bool = False
    loaded: bool = True
    why: list[str] = field(default_factory=list)

    def memory(self) -> MemoryUse | None:
        return use(self.mib) if self.loaded else None

    def busy(self) -> bool:
        return self.is_busy

    def evict(self, why: str) -> bool:
        self.loaded = False
        self.why.append(why)
        return True


def test_the_least_recently_used_goes_first_then_the_shortest_keep_alive() -> None:
    old = Fake("old", 400, last_used=1.0)
    short = Fake("short", 400, last_used=2.0, keep_alive=10.0)
    long = Fake("long", 400, last_used=2.0, keep_alive=600.0)
    budget = MemoryBudget(1600 * MIB)
    budget.make_room("new", use(1000), [long, short, old])
    assert [m.name for m in (old, short, long) if not m.loaded] == ["old", "short"]
    assert budget.evictions == [("old", "new"), ("short", "new")]
    assert "to make room for new" in old.why[0]


def test_nothing_is_evicted_when_what_is_missing_is_held_by_busy_or_pinned_models() -> None:
    busy = Fake("busy", 500, last_used=1.0, is_busy=True)
    idle = Fake("idle", 300, last_used=2.0)
    budget = MemoryBudget(1000 * MIB)
    with pytest.raises(OverBudget, match=r"busy \(busy\)") as raised:
        budget.make_room("new", use(600), [busy, idle])
    assert raised.value.transient  # the busy one ends: try again later
    assert idle.loaded
    assert busy.loaded

    pinned = Fake("pinned", 500, last_used=1.0, pinned=True)
    with pytest.raises(OverBudget, match=r"pinned \(pinned\)") as raised:
        budget.make_room("new", use(600), [pinned, idle])
    assert not raised.value.transient
    with pytest.raises(OverBudget, match="can never be loaded") as raised:
        budget.make_room("huge", use(1200), [])
    assert not raised.value.transient


def test_the_estimate_reads_the_models_shape_from_its_gguf_header() -> None:
    path = default_model_path()
    meta = gguf_metadata(path)
    # SmolLM2-135M's shape, as its model card and the gguf library's reader give it
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.block_count"], meta["llama.attention.head_count_kv"]) == (30, 3)
    assert (meta["llama.embedding_length"], meta["llama.attention.head_count"]) == (576, 9)
    f16 = estimate(path, slots=2, n_ctx=1024, cache_tokens=512, kv_type="f16")
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) x 2 bytes per cell
    assert f16.kv == 30 * 3 * 128 * 2 * 2048
    # the entries, held in the process's memory (the KV cache has cells for the slots only)
    assert f16.cache == 30 * 3 * 128 * 2 * 512
    assert f16.weights == path.stat().st_size
    q8 = estimate(path, slots=2, n_ctx=1024, cache_tokens=512, kv_type="q8_0")
    assert q8.kv == int(f16.kv * 34 / 64)


def test_a_file_that_is_not_gguf_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # cut short inside the header
    with pytest.raises(ModelLoadError, match="damaged GGUF header"):
        gguf_metadata(bad)
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="does not start with 'GGUF'"):
        gguf_metadata(bad)


def test_a_failed_load_fails_every_caller_that_waited_for_it_with_its_reason() -> None:
    calls: list[int] = []
    fail = threading.Event()
    release = threading.Event()

    def factory() -> list[ScriptedEngine]:
        calls.append(1)
        if fail.is_set():
            release.wait(10)
            raise ModelLoadError("the file went away")
        return [ScriptedEngine(["x"], delay=0)]

    with Runtime(keep_alive=None) as rt:
        model = rt.add_engines("m", factory)
        model.keep_loaded_for(0)  # idle: unloaded now
        assert model.state is ModelState.IDLE_UNLOADED
        fail.set()
        errors: list[BaseException] = []

        def submit() -> None:
            try:
                model.complete(prompt="hi", max_tokens=2)
            except ModelLoadError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=submit) for _ in range(5)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while model.state is not ModelState.LOADING:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.05)  # the others are waiting for that load now
        release.set()
        for t in threads:
            t.join(10)
        assert len(errors) == 5
        assert {str(e) for e in errors} == {"the file went away"}
        # One load for the burst: the first caller's, plus at most the callers that came
        # after it failed (none here: all were waiting before it did).
        assert len(calls) == 2
        assert "its last load failed: the file went away" in str(model.unloaded_because)
