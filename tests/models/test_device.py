"""Device detection from what llama.cpp reports about its own build."""

from __future__ import annotations

from tokenbelt.models import detect_device
from tokenbelt.models._device import device_info_from, parse_system_info

CPU_ONLY = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
WITH_CUDA = "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | " + CPU_ONLY
WITH_METAL = "Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 | "


def test_parse_system_info_splits_backends_and_cpu_features() -> None:
    backends, features = parse_system_info(WITH_CUDA)
    assert backends == ("CUDA", "CPU")
    assert "AVX2" in features
    assert "AVX512" in features
    assert "AVX512_VBMI" not in features, "features reported as 0 are not enabled"
    assert "ARCHS" not in features, "keys of other backends are not CPU features"


def test_cpu_only_build() -> None:
    info = device_info_from(False, CPU_ONLY)
    assert info.devices == ("cpu",)
    assert info.best == "cpu"
    assert info.reason.startswith("the installed llama.cpp build has no GPU offload")
    assert "AVX AVX2 AVX512 FMA F16C" in info.reason


def test_gpu_builds_put_the_gpu_first() -> None:
    cuda = device_info_from(True, WITH_CUDA)
    assert cuda.devices == ("cuda", "cpu")
    assert cuda.can_run("cpu")
    assert "offload to cuda" in cuda.reason
    metal = device_info_from(True, WITH_METAL)
    assert metal.devices == ("metal", "cpu")
    assert "NEON" in metal.reason


def test_offload_to_an_unknown_backend_runs_on_cpu_and_says_why() -> None:
    info = device_info_from(True, "SYCL : USE = 1 | " + CPU_ONLY)
    assert info.devices == ("cpu",)
    assert "SYCL" in info.reason
    assert "using cpu" in info.reason


def test_detect_device_on_this_machine() -> None:
    info = detect_device()
    assert info.devices[-1] == "cpu"
    assert info.reason
    assert detect_device() is info, "asked once per process"
