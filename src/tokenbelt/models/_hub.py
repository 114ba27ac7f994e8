"""``tokenbelt models pull hf://ORG/REPO/FILE.gguf``: a Hub file to a catalog alias, no JSON.

The Hub's own metadata gives the file's size and sha256 (the ``ETag`` of an LFS file)
and the commit the revision points to. The file is then downloaded like any ``url``
variant (resumable ``.partial`` file, sha256 checked on the way in, progress) from the
commit's immutable address, its GGUF header is read, and the alias is written to the
user catalog. Running the same pull again resumes an interrupted download.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .._errors import DownloadError, InvalidArgument, ModelError
from ._cache import ModelCache
from ._catalog import ModelEntry, Variant
from ._download import DownloadTimeouts, ProgressCallback, WaitCallback
from ._hf import check_resolves, endpoint, one_line_per_hub_record
from ._home import Home
from ._registry import check_alias, check_free, read_gguf_info, register
from ._sources import UrlSource

HF_SCHEME = "hf://"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_QUANT = re.compile(r"(?i)(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])")


@dataclass(frozen=True)
class HubFile:
    """One file on the Hub, as its metadata describes it."""

    repo: str
    file: str
    revision: str
    commit: str
    size: int
    sha256: str

    @property
    def uri(self) -> str:
        return f"{HF_SCHEME}{self.repo}/{self.file}"

    def url(self, endpoint: str) -> str:
        """The download address pinned to the commit: it never changes under the alias."""
        return f"{endpoint.rstrip('/')}/{self.repo}/resolve/{self.commit}/{self.file}"


def parse_hf_uri(uri: str) -> tuple[str, str]:
    """``hf://ORG/REPO/PATH/FILE.gguf`` to ``("ORG/REPO", "PATH/FILE.gguf")``."""
    rest = uri[len(HF_SCHEME) :] if uri.startswith(HF_SCHEME) else None
    parts = rest.split("/") if rest else []
    if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
        raise InvalidArgument(
            f"expected hf://ORG/REPO/FILE.gguf (the file's path in the repository), got {uri!r}"
        )
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])


#: how Ollama names a Hub repository: ``hf.co/ORG/REPO[:QUANT]``
OLLAMA_HUB_PREFIXES = ("hf.co/", "huggingface.co/")
#: the quantization Ollama pulls from a Hub repository when the name gives none
OLLAMA_DEFAULT_QUANT = "Q4_K_M"


def is_hub_name(name: str) -> bool:
    """True for ``hf://ORG/REPO/FILE.gguf`` and Ollama's ``hf.co/ORG/REPO[:QUANT]``."""
    return name.startswith(HF_SCHEME) or name.lower().startswith(OLLAMA_HUB_PREFIXES)


def hub_uri(name: str, revision: str = "main") -> str:
    """The ``hf://`` URI a Hub name stands for. Ollama's ``hf.co/ORG/REPO[:QUANT]``
    names the repository's GGUF file of that quantization (default ``Q4_K_M`` when the
    repository has it, else its only one), found by listing the repository (blocking).
    Raises ``InvalidArgument`` (not such a name) and ``DownloadError`` (no such file)."""
    if name.startswith(HF_SCHEME):
        parse_hf_uri(name)
        return name
    lowered = name.lower()
    prefix = next((p for p in OLLAMA_HUB_PREFIXES if lowered.startswith(p)), None)
    if prefix is None:
        raise InvalidArgument(
            f"expected hf://ORG/REPO/FILE.gguf or hf.co/ORG/REPO:QUANT, got {name!r}"
        )
    repo, _, quant = name[len(prefix) :].partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise InvalidArgument(f"expected hf.co/ORG/REPO or hf.co/ORG/REPO:QUANT, got {name!r}")
    files = [f for f in _repo_files(repo, revision) if f.endswith(".gguf") and "mmproj" not in f]
    by_quant: dict[str, list[str]] = {}
    for f in sorted(files):
        by_quant.setdefault(quantization_from_name(f) or "", []).append(f)
    if quant:
        chosen = by_quant.get(quant.upper())
    elif OLLAMA_DEFAULT_QUANT in by_quant:
        chosen = by_quant[OLLAMA_DEFAULT_QUANT]
    else:
        chosen = sorted(files)[:1] if len(by_quant) == 1 else None
    if not chosen:
        have = ", ".join(sorted(q for q in by_quant if q)) or "none"
        missing = (
            f"has no {quant.upper()} GGUF file"
            if quant
            else f"has no {OLLAMA_DEFAULT_QUANT} GGUF file and more than one other: name one"
        )
        raise DownloadError(f"{HF_SCHEME}{repo} {missing} (quantizations there: {have})")
    return f"{HF_SCHEME}{repo}/{chosen[0]}"


def _repo_files(repo: str, revision: str) -> list[str]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    one_line_per_hub_record()
    check_resolves()
    try:
        return list(HfApi(endpoint=endpoint()).list_repo_files(repo, revision=revision))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise DownloadError(
            f"{HF_SCHEME}{repo}@{revision} was not found on the Hub ({type(exc).__name__})"
        ) from exc
    except Exception as exc:  # the library's network errors, translated here
        raise DownloadError(
            f"cannot list the files of {HF_SCHEME}{repo} on {endpoint()}: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc


def default_alias(file: str) -> str:
    """An alias from the file name: ``SmolLM2-135M-Q8_0.gguf`` gives ``smollm2-135m-q8_0``."""
    stem = Path(file).name.removesuffix(".gguf").lower()
    alias = re.sub(r"[^a-z0-9._:-]+", "-", stem).strip("-._:")
    return alias[:100] or "model"


def quantization_from_name(file: str) -> str | None:
    found = _QUANT.search(Path(file).name)
    return found.group(1).upper() if found else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def hub_file(repo: str, file: str, revision: str = "main") -> HubFile:
    """Ask the Hub (``HEAD .../resolve/REVISION/FILE``) for the file's size, sha256, commit.

    Raises ``DownloadError`` when the Hub cannot be reached or has no such file, and
    when it gives no sha256 (a file not stored with LFS cannot be verified).
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    one_line_per_hub_record()

    described = f"{HF_SCHEME}{repo}/{file}@{revision}"
    url = hf_hub_url(repo, file, revision=revision, endpoint=endpoint())
    check_resolves()
    try:
        meta = get_hf_file_metadata(url)
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise DownloadError(
            f"{described} was not found on the Hub ({type(exc).__name__}); check the "
            "organisation, repository, file name and --revision"
        ) from exc
    except Exception as exc:  # the library's network errors, translated here
        raise DownloadError(
            f"cannot read the metadata of {described} from {endpoint()}: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    sha256 = (meta.etag or "").strip('"').lower()
    if not _SHA256.match(sha256):
        raise DownloadError(
            f"the Hub gives no sha256 for {described} (it is not stored with Git LFS), so "
            "tokenbelt cannot verify it; download it yourself and use `tokenbelt models add`"
        )
    if not meta.size or not meta.commit_hash:
        raise DownloadError(f"the Hub's answer for {described} has no size or commit")
    return HubFile(repo, file, revision, meta.commit_hash, int(meta.size), sha256)


@dataclass(frozen=True)
class PulledModel:
    entry: ModelEntry
    path: Path
    hub: HubFile


def pull_from_hub(
    uri: str,
    *,
    revision: str = "main",
    alias: str | None = None,
    device: str = "cpu",
    replace: bool = False,
    force: bool = False,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    timeouts: DownloadTimeouts | None = None,
    on_wait: WaitCallback | None = None,
    home: Home | None = None,
) -> PulledModel:
    """Resolve, download (resumably), verify and register a Hub file under an alias.

    Blocks while downloading and hashing; ``cancel`` and Ctrl-C keep the partial file,
    and the same call later resumes it. Raises ``InvalidArgument`` (a bad URI or alias),
    ``ModelError`` (the alias is taken), ``DownloadError`` or ``IntegrityError``.
    """
    home = home or Home.from_env()
    repo, file = parse_hf_uri(uri)
    alias = alias or default_alias(file)
    check_alias(alias, device)
    check_free(alias, replace=replace, force=force, home=home)
    hub = hub_file(repo, file, revision)
    variant = Variant(
        id=f"{alias}-hf",
        device=device,
        quantization=quantization_from_name(file),
        size=hub.size,
        sha256=hub.sha256,
        source=UrlSource(hub.url(endpoint())),
    )
    cache = ModelCache(home)
    if cache.local_path(variant) is not None and cache.state(variant) != "verified":
        # Left by an earlier pull under this alias (--replace): not this file.
        cache.remove(variant)
    path = cache.fetch(
        variant, progress=progress, cancel=cancel, timeouts=timeouts, on_wait=on_wait
    )
    cache.verify(variant, path, cancel=cancel)
    info = read_gguf_info(path)
    if info.context_length is None:
        raise ModelError(
            f"{hub.uri} has no {info.architecture}.context_length in its GGUF metadata; "
            "tokenbelt cannot run it"
        )
    entry = ModelEntry(
        alias=alias,
        family=info.basename or info.architecture or repo.split("/")[1],
        license=info.license or "unknown",
        context_length=info.context_length,
        variants=(
            Variant(
                id=variant.id,
                device=device,
                quantization=info.quantization or variant.quantization,
                size=variant.size,
                sha256=variant.sha256,
                source=variant.source,
            ),
        ),
        architecture=info.architecture,
        origin=home.catalog_file,
    )
    register(entry, replace=replace, force=force, home=home)
    return PulledModel(entry, path, hub)
