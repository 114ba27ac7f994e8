"""The Ollama API's model routes: tags, show, ps, version, pull, delete.

Names are the server's: loaded models, and the catalog's aliases whose file is on this
machine; ``name:latest`` is the same as ``name``. A pull fetches and verifies a
catalog model as ``tokenbelt models pull`` does; a delete removes what tokenbelt
downloaded for it (a file shipped in a package or registered from a path stays).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ... import __version__
from ..._errors import ModelError, UnknownModel
from ...models import (
    Catalog,
    GGUFInfo,
    Home,
    ModelCache,
    Variant,
    choose_variant,
    is_hub_name,
    read_gguf_info,
)
from ...runtime import ModelState
from ..core import (
    Asgi,
    DeferredResponse,
    EventStreamResponse,
    ServerState,
    Serving,
    ndjson,
    public,
    response_for,
)
from ._pull import CatalogPull, HubPull, Pull
from ._schemas import NameRequest, PullRequest, error_shape

#: the Ollama API release whose routes and fields these follow
OLLAMA_API_VERSION = "0.6.0"
NDJSON = "application/x-ndjson"


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


@functools.lru_cache(maxsize=32)
def _gguf(path: str, mtime_ns: int, size: int) -> GGUFInfo | None:
    """A GGUF header, read once per file version (the key holds its mtime and size)."""
    try:
        return read_gguf_info(Path(path))
    except ModelError:
        return None


@dataclass(frozen=True)
class Facts:
    """What Ollama's model routes report about one model."""

    name: str
    path: Path | None
    size: int
    modified_at: str
    digest: str
    family: str
    quantization: str
    architecture: str
    context_length: int
    license: str
    #: the parameter count as Ollama writes it (``134.52M``), from the GGUF's tensors
    parameter_size: str = ""

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family] if self.family else None,
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization,
        }

    def entry(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }


def _catalog() -> tuple[Catalog, ModelCache]:
    home = Home.from_env()
    return Catalog.load(home), ModelCache(home)


def local_name(state: ServerState, name: str) -> str:
    """``name`` without an Ollama ``:latest`` tag, unless that tag is part of a real name."""
    base, _, tag = name.rpartition(":")
    if tag == "latest" and base and name not in state.model_names():
        return base
    return name


def facts(state: ServerState, name: str) -> Facts | None:
    """What is known of a loaded model or a catalog alias; None if it is neither (blocking)."""
    model = state.runtime.models.get(name)
    catalog, cache = _catalog()
    info: dict[str, Any] = model.info if model is not None else {}
    alias = info.get("alias", name)
    variant: Variant | None = None
    entry = None
    if alias in catalog:
        entry, variant = catalog.lookup(alias)
        if variant is None:
            chosen = [v for v in entry.variants if v.id == info.get("variant")]
            cached = [v for v in entry.variants if cache.local_path(v) is not None]
            variant = (chosen or cached or list(entry.variants))[0]
    elif model is None:
        return None
    path: Path | None = Path(info["path"]) if "path" in info else None
    if path is None and variant is not None:
        path = cache.local_path(variant)
    stat = path.stat() if path is not None and path.is_file() else None
    header = _gguf(str(path), stat.st_mtime_ns, stat.st_size) if stat else None
    modified = datetime.fromtimestamp(stat.st_mtime, UTC) if stat else datetime.now(UTC)
    context = model.context_length if model is not None else 0
    arch = (header.architecture if header else None) or (entry.architecture if entry else None)
    return Facts(
        name=name,
        path=path,
        size=stat.st_size if stat else (variant.size if variant else 0),
        modified_at=_iso(modified),
        digest=f"sha256:{variant.sha256}" if variant else "",
        family=entry.family if entry else (arch or ""),
        quantization=(variant.quantization if variant else None)
        or (header.quantization if header else None)
        or "",
        architecture=arch or "",
        context_length=context or (entry.context_length if entry else 0),
        license=(entry.license if entry else None) or (header.license if header else None) or "",
        parameter_size=header.parameter_size if header else "",
    )


def _tags(state: ServerState) -> list[dict[str, Any]]:
    names = list(state.runtime.models)
    catalog, cache = _catalog()
    for entry in catalog:
        on_disk = any(cache.local_path(v) is not None for v in entry.variants)
        if on_disk and entry.alias not in names:
            names.append(entry.alias)
    found = [facts(state, name) for name in names]
    return [f.entry() for f in found if f is not None]


def _show(state: ServerState, name: str) -> dict[str, Any]:
    found = facts(state, name)
    if found is None:
        raise UnknownModel(f"model {name!r} not found")
    model = state.runtime.models.get(name)
    arch = found.architecture
    model_info: dict[str, Any] = {"general.architecture": arch or None}
    if arch and found.context_length:
        model_info[f"{arch}.context_length"] = found.context_length
    return {
        "modelfile": f"FROM {found.path}\n" if found.path else "",
        "parameters": "",
        "template": "",
        "license": found.license,
        "details": found.details(),
        "model_info": model_info,
        # A GGUF tokenbelt runs itself takes tools (its grammar makes every call parse);
        # a remote or scripted engine constrains nothing, so it is not said to.
        "capabilities": (["completion", "tools"] if found.path else ["completion"])
        # a loaded thinking model (its template writes <think>): ``think`` applies
        + (["thinking"] if model is not None and model.thinks else [])
        # a loaded model whose vocabulary has FIM tokens: ``suffix`` (and /infill) apply
        + (["insert"] if model is not None and model.fills_middle else []),
        "modified_at": found.modified_at,
        "tokenbelt": {
            "loaded": model is not None,
            "state": model.state.value if model is not None else "available",
            "path": str(found.path) if found.path else None,
            "digest": found.digest or None,
        },
    }


def _ps(state: ServerState) -> list[dict[str, Any]]:
    out = []
    for name, model in state.runtime.models.items():
        if model.state is not ModelState.READY:
            continue
        found = facts(state, name)
        if found is None:
            continue
        keep = model.idle_keep_alive
        # When it would unload if no request came from now on (null: it never unloads).
        expires = None if keep is None else _iso(datetime.now(UTC) + timedelta(seconds=keep))
        on_gpu = model.info.get("device") not in (None, "cpu")
        status = model.status()
        # Ollama's size here is what the loaded model holds (weights and KV cache), not
        # its file: tokenbelt's count of it, measured once its worker runs.
        size = status.memory.total if status.memory is not None else found.size
        out.append(
            {
                **found.entry(),
                "size": size,
                "expires_at": expires,
                "size_vram": size if on_gpu else 0,
                "context_length": model.context_length,
                "tokenbelt": status.to_dict(),
            }
        )
    return out


def _delete(state: ServerState, name: str) -> list[str]:
    catalog, cache = _catalog()
    entry, exact = catalog.lookup(name)
    removed: list[Path] = []
    for variant in [exact] if exact is not None else entry.variants:
        removed += cache.remove(variant)
    return [str(p) for p in removed]


#: the model routes; the Ollama router (``_routes``) includes them under ``/api``
router = APIRouter()


@router.get("/tags", summary="Ollama: the models on this machine")
async def tags(path: Serving) -> dict[str, Any]:
    return {"models": await anyio.to_thread.run_sync(_tags, path.state)}


@router.post("/show", summary="Ollama: what is known of one model")
async def show(body: NameRequest, path: Serving) -> dict[str, Any]:
    name = local_name(path.state, body.which)
    shown: dict[str, Any] = public(await anyio.to_thread.run_sync(_show, path.state, name))
    return shown  # ``modelfile`` names the file, not where it is (unless the admin asked)


@router.get("/ps", summary="Ollama: the models loaded now")
async def ps(path: Serving) -> dict[str, Any]:
    return {"models": await anyio.to_thread.run_sync(_ps, path.state)}


@router.get("/version", summary="Ollama: the API version these routes follow")
async def version() -> dict[str, Any]:
    return {"version": OLLAMA_API_VERSION, "tokenbelt": __version__}


@router.post("/pull", summary="Ollama: fetch and verify a catalog model (NDJSON progress)")
async def pull(body: PullRequest, path: Serving) -> Response:
    def choose() -> Pull:
        if is_hub_name(body.which):  # hf://ORG/REPO/FILE.gguf, hf.co/ORG/REPO:QUANT
            return HubPull(body.which)
        catalog, cache = _catalog()
        name = local_name(path.state, body.which)
        return CatalogPull(cache, choose_variant(catalog, name, cache=cache).variant)

    job = await anyio.to_thread.run_sync(choose)
    job.start()
    if body.stream:
        return Asgi(
            EventStreamResponse(job.stop, job.lines(), {}, encode=ndjson, media_type=NDJSON)
        )

    async def compute() -> Response:
        async for _ in job.lines():
            pass
        if job.error is not None:
            return response_for(job.error, shape=error_shape)
        return JSONResponse({"status": "success"})

    later: Callable[[], Awaitable[Callable[[Scope, Receive, Send], Awaitable[None]]]] = compute
    return Asgi(DeferredResponse(job.stop, later))


@router.delete("/delete", summary="Ollama: remove what tokenbelt downloaded for a model")
async def delete(body: NameRequest, path: Serving) -> dict[str, Any]:
    name = local_name(path.state, body.which)
    return {"removed": await anyio.to_thread.run_sync(_delete, path.state, name)}
