"""Layer 3: catalog, alias to variant resolution, download cache, probe.

The runtime's entry point is ``resolve_and_fetch(alias)``: it returns a verified local
file (``ResolvedModel``) or raises; a corrupt or truncated file is never returned.
"""

from ..engines import GGUFHeader, read_header
from ._cache import ModelCache
from ._catalog import DEVICES, NAME_PATTERN, Catalog, ModelEntry, Variant
from ._device import DeviceInfo, detect_device
from ._download import DownloadResult, DownloadTimeouts, download
from ._embedded import default_model_path, distribution_file
from ._home import Home
from ._hub import HF_SCHEME, hub_uri, is_hub_name, pull_from_hub
from ._probe import ProbeReport, run_probe
from ._registry import GGUFInfo, add_model, forget_model, read_gguf_info
from ._remote import RemoteEntry, add_remote, find_remote, remote_entries
from ._resolve import DEFAULT_ALIAS, Choice, ResolvedModel, choose_variant, resolve_and_fetch
from ._sources import DistributionSource, HuggingFaceSource, PathSource, Source, UrlSource
from ._speech import SPEECH_MODELS, SpeechEntry, SpeechModel, is_speech_model, resolve_speech

__all__ = [
    "DEFAULT_ALIAS",
    "DEVICES",
    "HF_SCHEME",
    "NAME_PATTERN",
    "SPEECH_MODELS",
    "Catalog",
    "Choice",
    "DeviceInfo",
    "DistributionSource",
    "DownloadResult",
    "DownloadTimeouts",
    "GGUFHeader",
    "GGUFInfo",
    "Home",
    "HuggingFaceSource",
    "ModelCache",
    "ModelEntry",
    "PathSource",
    "ProbeReport",
    "RemoteEntry",
    "ResolvedModel",
    "Source",
    "SpeechEntry",
    "SpeechModel",
    "UrlSource",
    "Variant",
    "add_model",
    "add_remote",
    "choose_variant",
    "default_model_path",
    "detect_device",
    "distribution_file",
    "download",
    "find_remote",
    "forget_model",
    "hub_uri",
    "is_hub_name",
    "is_speech_model",
    "pull_from_hub",
    "read_gguf_info",
    "read_header",
    "remote_entries",
    "resolve_and_fetch",
    "resolve_speech",
    "run_probe",
]
