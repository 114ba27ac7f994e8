"""Alias to variant per device, then fetch and verify; a bad file is never returned."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import (
    DownloadCancelled,
    IntegrityError,
    InvalidArgument,
    ModelError,
    UnknownModel,
)
from tokenbelt.models import (
    DEFAULT_ALIAS,
    Catalog,
    DownloadTimeouts,
    Home,
    ModelCache,
    choose_variant,
    default_model_path,
    resolve_and_fetch,
)
from tokenbelt.models._catalog import shipped_entries

from .conftest import CPU_ONLY, CUDA, catalog_of, payload, url_entry
from .fileserver import FileServer, Served

FAST = DownloadTimeouts(connect=2.0, stall=1.0)


def two_device_entry(server: FileServer) -> dict[str, Any]:
    cpu = server.files["/cpu.gguf"] = Served(payload(seed=3))
    cuda = server.files["/cuda.gguf"] = Served(payload(seed=5))
    e = url_entry("m", server.url("/cpu.gguf"), cpu, id="m-cpu")
    e["variants"].append(
        url_entry("m", server.url("/cuda.gguf"), cuda, id="m-cuda", device="cuda")["variants"][0]
    )
    return e


def test_best_device_wins_when_nothing_is_cached(server: FileServer, home: Home) -> None:
    catalog = catalog_of(two_device_entry(server))
    choice = choose_variant(catalog, "m", info=CUDA)
    assert (choice.variant.id, choice.device) == ("m-cuda", "cuda")
    assert "test machine: cuda" in choice.reason
    cpu_choice = choose_variant(catalog, "m", info=CPU_ONLY)
    assert (cpu_choice.variant.id, cpu_choice.device) == ("m-cpu", "cpu")


def test_a_cached_variant_is_preferred(server: FileServer, home: Home) -> None:
    catalog = catalog_of(two_device_entry(server))
    resolve_and_fetch("m-cpu", catalog=catalog, info=CUDA, timeouts=FAST)
    choice = choose_variant(catalog, "m", info=CUDA)
    assert choice.variant.id == "m-cpu"
    assert "already on disk" in choice.reason


def test_device_override_and_full_variant_id(server: FileServer, home: Home) -> None:
    catalog = catalog_of(two_device_entry(server))
    assert choose_variant(catalog, "m", device="cpu", info=CUDA).variant.id == "m-cpu"
    with pytest.raises(ModelError, match="--device cuda was asked but test machine: cpu only"):
        choose_variant(catalog, "m", device="cuda", info=CPU_ONLY)
    with pytest.raises(InvalidArgument, match="unknown device 'tpu'"):
        choose_variant(catalog, "m", device="tpu", info=CPU_ONLY)
    # a named variant runs; on a machine without its device it runs on the cpu, and says so
    named = choose_variant(catalog, "m-cuda", info=CPU_ONLY)
    assert (named.variant.id, named.device) == ("m-cuda", "cpu")
    assert "cannot offload to cuda" in named.reason
    with pytest.raises(ModelError, match="is the cuda variant but --device cpu"):
        choose_variant(catalog, "m-cuda", device="cpu", info=CUDA)


def test_no_runnable_variant_is_an_error_not_a_fallback(server: FileServer, home: Home) -> None:
    e = two_device_entry(server)
    e["variants"] = e["variants"][1:]  # cuda only
    catalog = catalog_of(e)
    with pytest.raises(ModelError, match="none of the variants of 'm' runs here"):
        choose_variant(catalog, "m", info=CPU_ONLY)
    with pytest.raises(UnknownModel, match="'m' has no cpu variant"):
        choose_variant(catalog, "m", device="cpu", info=CUDA)


def test_unknown_alias_is_never_replaced_by_the_default(home: Home) -> None:
    with pytest.raises(UnknownModel, match="did you mean 'smollm2-135m'"):
        resolve_and_fetch("smollm2", info=CPU_ONLY)


def test_default_model_resolves_to_the_packaged_file(home: Home) -> None:
    resolved = resolve_and_fetch(DEFAULT_ALIAS)
    assert resolved.path == default_model_path()
    assert resolved.variant == "smollm2-135m-instruct-q4_1-cpu"
    assert resolved.verified
    assert resolved.hashed
    assert resolved.context_length == 8192
    assert resolved.device in ("cpu", "cuda", "metal", "vulkan")
    assert resolved.device_reason
    assert resolved.n_gpu_layers == (0 if resolved.device == "cpu" else -1)
    # the stamp vouches for the unchanged file: no second hash
    assert not resolve_and_fetch(DEFAULT_ALIAS).hashed


def test_url_model_downloads_once_then_comes_from_the_cache(server: FileServer, home: Home) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    catalog = catalog_of(url_entry("m", server.url("/m.gguf"), served))
    first = resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY, timeouts=FAST)
    assert first.path == home.models_dir / "m-q8-cpu.gguf"
    assert first.path.read_bytes() == served.data
    assert not first.hashed, "hashed while downloading: the stamp is written at once"
    second = resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY)
    assert second.path == first.path
    assert not second.hashed
    assert len(server.gets) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "zeros"])
def test_a_corrupt_cached_file_is_refused_before_load(
    server: FileServer, home: Home, damage: str
) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    catalog = catalog_of(url_entry("m", server.url("/m.gguf"), served))
    path = resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY, timeouts=FAST).path
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:  # the interrupted download that left a full-size file of zeros
        data = bytearray(len(data))
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY)
    message = str(info.value)
    assert str(path) in message
    assert ("truncated" in message) if damage == "truncate" else ("sha256" in message)
    assert "tokenbelt models rm m-q8-cpu" in message
    assert len(server.gets) == 1, "a corrupt file is reported, not silently fetched again"


def test_stamp_is_ignored_once_the_file_changes(server: FileServer, home: Home) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    catalog = catalog_of(url_entry("m", server.url("/m.gguf"), served))
    path = resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY, timeouts=FAST).path
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY).hashed
    assert not resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY).hashed


def test_path_source_that_disappeared(tmp_path: Path, home: Home) -> None:
    served = Served(payload())
    e = url_entry("local", "https://unused", served)
    e["variants"][0]["source"] = {"type": "path", "path": str(tmp_path / "gone.gguf")}
    with pytest.raises(ModelError, match=r"gone\.gguf .* does not exist"):
        resolve_and_fetch("local", catalog=catalog_of(e), info=CPU_ONLY)


def test_missing_distribution_is_a_clear_error(home: Home) -> None:
    served = Served(payload())
    e = url_entry("pkg", "https://unused", served)
    e["variants"][0]["source"] = {
        "type": "distribution",
        "distribution": "tokenbelt-no-such-package",
        "file": "x/m.gguf",
    }
    catalog = catalog_of(e)
    assert ModelCache(home).state(catalog.get("pkg").variants[0]) == "absent"
    with pytest.raises(UnknownModel, match="pip install tokenbelt-no-such-package"):
        resolve_and_fetch("pkg", catalog=catalog, info=CPU_ONLY)


def test_cancel_through_resolve_and_fetch(server: FileServer, home: Home) -> None:
    served = server.files["/m.gguf"] = Served(payload())
    catalog = catalog_of(url_entry("m", server.url("/m.gguf"), served))
    cancel = threading.Event()

    def progress(received: int, total: int | None) -> None:
        assert total == len(served.data)
        cancel.set()

    with pytest.raises(DownloadCancelled):
        resolve_and_fetch(
            "m", catalog=catalog, info=CPU_ONLY, progress=progress, cancel=cancel, timeouts=FAST
        )
    cache = ModelCache(home)
    variant = catalog.get("m").variants[0]
    assert cache.state(variant).startswith("partial ")
    resolved = resolve_and_fetch("m", catalog=catalog, info=CPU_ONLY, timeouts=FAST)
    assert resolved.path.read_bytes() == served.data
    assert cache.state(variant) == "verified"
    assert cache.remove(variant) == [resolved.path]
    assert cache.state(variant) == "absent"


def test_shipped_catalog_is_the_default(home: Home) -> None:
    assert [e.alias for e in Catalog.load(home)] == [e.alias for e in shipped_entries()]
