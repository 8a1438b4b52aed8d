"""The GPU side of a device: which backend the engine was built with, free VRAM, and copy speeds on CUDA.

Nothing here imports llama_cpp: the backend is read off the engine's library folder (llama-cpp-python ships
libggml-cuda / libggml-metal beside libllama when built with them), free VRAM comes from nvidia-smi or the CUDA
runtime, and copies are timed through the CUDA runtime with ctypes. Figures llama.cpp prints while it opens a
GPU (free VRAM, Metal's recommended working set) are read from its log when the engine has run on the GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from primaplug.core.profiles import Backend

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

# cudaMemcpyKind (cuda_runtime_api.h)
H2D, D2H, D2D = 1, 2, 3


def detect_backend(lib_names: Iterable[str]) -> Backend:
    """"cuda" or "metal" when the engine's library folder holds that ggml backend, else "cpu"."""
    names = [n.lower() for n in lib_names]
    if any(n.startswith("libggml-cuda") or n.startswith("ggml-cuda") for n in names):
        return "cuda"
    if any(n.startswith("libggml-metal") or n.startswith("ggml-metal") for n in names):
        return "metal"
    return "cpu"


def engine_lib_names() -> list[str]:
    """File names in the folder llama-cpp-python loads libllama from (found without importing it): its own lib
    folder, or $LLAMA_CPP_LIB_PATH, which llama-cpp-python's loader takes instead when it is set."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return os.listdir(override) if os.path.isdir(override) else []
    spec = importlib.util.find_spec("llama_cpp")
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(folder, "lib")
        if os.path.isdir(lib):
            return os.listdir(lib)
    return []


def engine_backend() -> Backend:
    """The GPU backend the installed engine was built with ("cpu": none), from its library folder."""
    return detect_backend(engine_lib_names())


def unified_memory(backend: Backend, machine: str) -> bool:
    """I^UMA: Metal on Apple silicon shares one memory between CPU and GPU."""
    return backend == "metal" and machine in ("arm64", "aarch64")


# --- free VRAM and figures from llama.cpp's log ------------------------------------------------------------------


def parse_nvidia_smi_free(text: str) -> int:
    """Free memory of the first GPU from `nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits` (MiB)."""
    for line in text.splitlines():
        value = line.strip().split(",")[0].strip()
        if value.isdigit():
            return int(value) << 20
    raise ValueError(f"no free-memory figure in nvidia-smi's output: {text[:200]!r}")


def parse_logged_vram_free(lines: Iterable[str]) -> int | None:
    """'... using device CUDA0 (NVIDIA ...) (...) - 80000 MiB free' (llama.cpp, at model load)."""
    for line in lines:
        m = re.search(r"using device CUDA\d+ .* - (\d+) MiB free", line)
        if m:
            return int(m.group(1)) << 20
    return None


def parse_logged_metal_working_set(lines: Iterable[str]) -> int | None:
    """'ggml_metal_device_init: recommendedMaxWorkingSetSize  = 11453.25 MB' (llama.cpp, MB of 10^6 bytes)."""
    for line in lines:
        m = re.search(r"recommendedMaxWorkingSetSize\s*=\s*([\d.]+) MB", line)
        if m:
            return int(float(m.group(1)) * 1e6)
    return None


def nvidia_smi_command(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The nvidia-smi command that reads the free memory of the GPU llama.cpp puts GPU layers on (CUDA's device 0):
    the first device CUDA_VISIBLE_DEVICES names (an index or a UUID, which nvidia-smi's --id takes as well; nvidia-smi
    itself ignores the variable), GPU 0 without it. None when the variable hides every device ("" or "-1")."""
    env = os.environ if env is None else env
    cmd = ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cmd
    first = visible.split(",")[0].strip()
    if not first or first.startswith("-"):  # CUDA stops at the first entry it cannot read: no device
        return None
    return [*cmd, f"--id={first}"]


def cuda_free_vram(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                   runtime: Callable[[], Runtime | None] | None = None, env: Mapping[str, str] | None = None) -> int:
    """d^avail_cuda now: nvidia-smi when it is there, else the CUDA runtime (Jetson boards have no nvidia-smi),
    else 0 (no GPU the plan can use: also when the runtime is installed but finds no device or no driver)."""
    cmd = nvidia_smi_command(env)
    if cmd is None:
        return 0
    try:
        out = run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return parse_nvidia_smi_free(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    rt = (runtime or CudaRuntime.load)()
    if rt is None:
        return 0
    try:
        return rt.mem_get_info()[0]
    except RuntimeError as e:  # cudaErrorNoDevice, cudaErrorInsufficientDriver: a CUDA toolkit without a GPU
        logger.info("the CUDA runtime reads no free VRAM (%s): planning without this GPU", e)
        return 0


# --- the CUDA runtime through ctypes -----------------------------------------------------------------------------


class Runtime(Protocol):
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...


class CudaRuntime:
    """The few libcudart calls the profiler needs; every copy is synchronous (cudaMemcpy, then a device sync)."""

    NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "cudart64_12.dll")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        for fn in (lib.cudaMalloc, lib.cudaFree, lib.cudaMemcpy, lib.cudaMemGetInfo, lib.cudaDeviceSynchronize):
            fn.restype = ctypes.c_int

    @classmethod
    def load(cls) -> CudaRuntime | None:
        names = [*([found] if (found := ctypes.util.find_library("cudart")) else []), *cls.NAMES]
        for name in names:
            try:
                return cls(ctypes.CDLL(name))
            except (OSError, AttributeError):
                continue
        return None

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUDA error {code}")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self._lib.cudaFree(ptr)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._check(self._lib.cudaMemcpy(dst, src, nbytes, kind), "cudaMemcpy")
        self._check(self._lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self._lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return int(free.value), int(total.value)


@dataclass(frozen=True)
class CopySpeeds:
    h2d_bps: float
    d2h_bps: float
    latency_s: float  # one small copy either way (the fixed cost of t^{ram-vram} and t^{vram-ram})
    d2d_bps: float  # bytes read per second by a device-to-device copy (VRAM read throughput, T^gpu)


def measure_cuda_copies(rt: Runtime, *, small: int = 16 << 10, large: int = 64 << 20, repeats: int = 5,
                        clock: Clock = time.perf_counter) -> CopySpeeds:
    """Copy times between pageable host memory (where the engine keeps hidden states) and VRAM: small copies give
    the latency, large ones the throughput once the latency is taken off. A device-to-device copy reads and
    writes VRAM, so it reads at twice its copy rate."""
    host = np.ones(large, dtype=np.uint8)
    dev_a, dev_b = rt.malloc(large), rt.malloc(large)
    try:
        def timed(dst: int, src: int, n: int, kind: int) -> float:
            rt.memcpy(dst, src, n, kind)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = clock()
                rt.memcpy(dst, src, n, kind)
                times.append(clock() - t0)
            return statistics.median(times)

        h = host.ctypes.data
        latency = (timed(dev_a, h, small, H2D) + timed(h, dev_a, small, D2H)) / 2
        h2d = large / max(timed(dev_a, h, large, H2D) - latency, 1e-9)
        d2h = large / max(timed(h, dev_a, large, D2H) - latency, 1e-9)
        d2d = 2 * large / max(timed(dev_b, dev_a, large, D2D), 1e-9)
        return CopySpeeds(h2d, d2h, latency, d2d)
    finally:
        rt.free(dev_a)
        rt.free(dev_b)
