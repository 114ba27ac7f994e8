"""``models add``: GGUF metadata, the user catalog, stamps, forgetting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenbelt import InvalidArgument, ModelError
from tokenbelt.models import (
    DEFAULT_ALIAS,
    Catalog,
    Home,
    ModelCache,
    PathSource,
    add_model,
    default_model_path,
    forget_model,
    read_gguf_info,
    resolve_and_fetch,
)

from .conftest import CPU_ONLY


def tiny_gguf(path: Path, *, arch: str = "llama", context: int | None = 2048) -> Path:
    """A small but real GGUF file (header, metadata, one tensor) written with ``gguf``."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_file_type(7)  # Q8_0
    if context is not None:
        writer.add_context_length(context)
    writer.add_tensor("weights", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_read_gguf_info_of_the_default_model() -> None:
    info = read_gguf_info(default_model_path())
    assert info.architecture == "llama"
    assert info.context_length == 8192
    assert info.quantization == "Q4_1"
    assert info.license == "apache-2.0"


def test_add_registers_reads_metadata_and_stamps(tmp_path: Path, home: Home) -> None:
    file = tiny_gguf(tmp_path / "tiny.gguf")
    entry = add_model(file, "tiny")
    assert (entry.architecture, entry.context_length) == ("llama", 2048)
    (variant,) = entry.variants
    assert variant.id == "tiny-local"
    assert variant.quantization == "Q8_0"
    assert variant.source == PathSource(file)
    assert variant.size == file.stat().st_size
    saved = json.loads(home.catalog_file.read_text())
    assert [m["alias"] for m in saved["models"]] == ["tiny"]
    catalog = Catalog.load(home)
    assert catalog.get("tiny").origin == home.catalog_file
    assert ModelCache(home).state(variant) == "verified"
    resolved = resolve_and_fetch("tiny", info=CPU_ONLY)
    assert resolved.path == file
    assert not resolved.hashed
    # a second add never loses the first
    add_model(tiny_gguf(tmp_path / "other.gguf", context=512), "other")
    aliases = [e.alias for e in Catalog.load(home)]
    assert aliases[0] == DEFAULT_ALIAS
    assert aliases[-2:] == ["tiny", "other"]


def test_add_refuses_taken_aliases_unless_replace(tmp_path: Path, home: Home) -> None:
    file = tiny_gguf(tmp_path / "tiny.gguf")
    add_model(file, "tiny")
    with pytest.raises(ModelError, match="the alias 'tiny' is taken"):
        add_model(file, "tiny")
    with pytest.raises(ModelError, match=f"the alias '{DEFAULT_ALIAS}' is taken"):
        add_model(file, DEFAULT_ALIAS)
    tiny_gguf(file, context=4096)
    assert add_model(file, "tiny", replace=True).context_length == 4096
    assert len(json.loads(home.catalog_file.read_text())["models"]) == 1


def test_a_changed_local_file_is_refused(tmp_path: Path, home: Home) -> None:
    file = tiny_gguf(tmp_path / "tiny.gguf")
    add_model(file, "tiny")
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="register it again"):
        resolve_and_fetch("tiny", info=CPU_ONLY)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a model at all", "is not a GGUF model file"),
        (b"GGUF\x03\x00\x00\x00", "damaged GGUF header"),
    ],
)
def test_add_rejects_files_that_are_not_gguf(
    tmp_path: Path, home: Home, content: bytes, message: str
) -> None:
    file = tmp_path / "bad.gguf"
    file.write_bytes(content)
    with pytest.raises(ModelError, match=message):
        add_model(file, "bad")
    assert not home.catalog_file.exists()


def test_add_checks_its_arguments(tmp_path: Path, home: Home) -> None:
    file = tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(InvalidArgument, match="alias 'no spaces'"):
        add_model(file, "no spaces")
    with pytest.raises(InvalidArgument, match="unknown device"):
        add_model(file, "tiny", device="tpu")
    with pytest.raises(ModelError, match="does not exist"):
        add_model(tmp_path / "missing.gguf", "tiny")
    with pytest.raises(ModelError, match=r"no llama\.context_length"):
        add_model(tiny_gguf(tmp_path / "noctx.gguf", context=None), "noctx")


def test_forget_drops_only_user_entries(tmp_path: Path, home: Home) -> None:
    file = tiny_gguf(tmp_path / "tiny.gguf")
    add_model(file, "tiny")
    assert forget_model("tiny").alias == "tiny"
    assert "tiny" not in Catalog.load(home)
    assert file.exists(), "the user's file is never deleted"
    with pytest.raises(ModelError, match="comes with tokenbelt"):
        forget_model(DEFAULT_ALIAS)
