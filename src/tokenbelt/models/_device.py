"""What this machine can run: the devices the installed llama.cpp build can offload to.

llama.cpp reports its compiled backends and CPU features in one line
(``llama_print_system_info``), for example::

    CUDA : ARCHS = 890 | USE_GRAPHS = 1 | CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 |

and ``llama_supports_gpu_offload()`` says whether layers can leave the CPU at all.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ._catalog import DEVICES

# llama.cpp backend names, as printed in the system info line, to catalog device names
_BACKENDS = {"cuda": "cuda", "metal": "metal", "mtl": "metal", "vulkan": "vulkan"}
_PART = re.compile(r"^\s*(?:(?P<backend>[A-Za-z][\w-]*) : )?(?P<key>\w+) = (?P<value>\S+)\s*$")
#: CPU features worth showing in a report, in this order
_CPU_FEATURES = (
    "AVX",
    "AVX2",
    "AVX512",
    "AVX512_VNNI",
    "AVX512_BF16",
    "FMA",
    "F16C",
    "NEON",
    "ARM_FMA",
    "SVE",
    "AMX_INT8",
)


@dataclass(frozen=True)
class DeviceInfo:
    """The devices this process can run a model on, best first (``cpu`` is always last)."""

    devices: tuple[str, ...]
    gpu_offload: bool
    backends: tuple[str, ...]
    cpu_features: tuple[str, ...]
    #: one human sentence: why these devices
    reason: str

    @property
    def best(self) -> str:
        return self.devices[0]

    def can_run(self, device: str) -> bool:
        return device in self.devices


def parse_system_info(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(backend names, enabled CPU features) from llama.cpp's system info line."""
    backends: list[str] = []
    features: list[str] = []
    current: str | None = None
    for part in text.split("|"):
        m = _PART.match(part)
        if m is None:
            continue
        if m["backend"]:
            current = m["backend"]
            if current not in backends:
                backends.append(current)
        if current == "CPU" and m["value"] == "1":
            features.append(m["key"])
    return tuple(backends), tuple(features)


def device_info_from(gpu_offload: bool, system_info: str) -> DeviceInfo:
    """Decide the runnable devices from what llama.cpp reports (pure, for tests)."""
    backends, features = parse_system_info(system_info)
    gpus: list[str] = []
    for name in backends:
        device = _BACKENDS.get(name.lower())
        if device is not None and device not in gpus:
            gpus.append(device)
    gpus.sort(key=DEVICES.index)
    shown = [f for f in _CPU_FEATURES if f in features]
    cpu = f"CPU features: {' '.join(shown)}" if shown else "no notable CPU features reported"
    if gpu_offload and gpus:
        reason = f"llama.cpp can offload to {', '.join(gpus)} (GPU offload supported); {cpu}"
        devices = (*gpus, "cpu")
    elif gpu_offload:
        others = ", ".join(b for b in backends if b != "CPU") or "an unnamed backend"
        reason = (
            f"llama.cpp offloads to {others}, which no catalog device matches; using cpu; {cpu}"
        )
        devices = ("cpu",)
    else:
        reason = f"the installed llama.cpp build has no GPU offload (CPU backend only); {cpu}"
        devices = ("cpu",)
    return DeviceInfo(devices, gpu_offload, backends, tuple(features), reason)


@functools.cache
def detect_device() -> DeviceInfo:
    """Ask the installed llama.cpp what it can run on (once per process)."""
    import llama_cpp

    raw = llama_cpp.llama_print_system_info()
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return device_info_from(bool(llama_cpp.llama_supports_gpu_offload()), text)
