"""The device profiler: what this device can do, as Halda's latency model needs it (a DeviceProfile).

Speeds are measured once and cached on the device (primaplug/profiler/cache.py); memory is read fresh on every
call. On a 2-core machine measuring took about 8 s the first time (the calibration models written) and 3 s when
forced again, up to 20 s while other work kept the cores busy; a cached profile takes milliseconds.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from primaplug.core.profiles import QUANT_TYPES, Backend, DeviceProfile, OsName
from primaplug.core.settings import usable_cores
from primaplug.engine.ensure import installed_version
from primaplug.memory.heap import return_freed_memory
from primaplug.profiler import cache, gpu, osinfo, throughput
from primaplug.profiler.compute import engine_log, measure_flops, types_to_measure

logger = logging.getLogger(__name__)

# tokens per timed batch: ggml hands CPU matmuls of 32 or more rows to the GPU when the build has one
# (op offload), so a GPU build times its CPU with fewer tokens
CPU_TOKENS, CPU_TOKENS_GPU_BUILD, GPU_TOKENS = 64, 16, 256
DISK_TEST_BYTES = 256 << 20
MEMORY_TEST_BYTES = (256 << 20, 512 << 20)  # at least (past every cache), at most


def engine_version() -> str:
    return installed_version() or "none"


def _disk_id(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def fingerprint(os_name: OsName, backend: Backend, disk_path: Path) -> cache.Fingerprint:
    return cache.Fingerprint(
        cpu_model=osinfo.current_cpu_model(os_name), cpu_count=usable_cores(),
        mem_total_bytes=psutil.virtual_memory().total, os=os_name, kernel=platform.release(),
        machine=platform.machine(), engine=engine_version(), backend=backend, cgroup=osinfo.cgroup_identity(),
        disk=_disk_id(disk_path),
    )


def profile_device(
    name: str,
    *,
    model_types: Sequence[str] = QUANT_TYPES,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    model_path: str | os.PathLike[str] | None = None,
    layer_bytes: int = 0,
    use_gpu: bool = True,
) -> DeviceProfile:
    """Profile this device for a model whose weights use `model_types` (measured types, see normalise_type).

    cache_dir: where measurements are cached (default ~/.cache/primaplug/profiles). force: measure again even
    when the cache has this device. model_path: read the model file for the disk figures (its first 256 MB)
    instead of a test file written into cache_dir; profile before loading the model, since its pages are dropped
    from the page cache. layer_bytes: one layer's weight bytes, to size the memory-read buffer like the tensors
    the device will read. use_gpu: measure the GPU when the engine has one.
    """
    folder = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os_name = osinfo.current_os()
    backend = gpu.detect_backend(gpu.engine_lib_names()) if use_gpu else "cpu"
    fp = fingerprint(os_name, backend, Path(model_path) if model_path else folder)
    types = types_to_measure(model_types)

    measured = None if force else cache.load(folder, fp)
    if measured is None:
        measured = measure_device(fp, types, cache_dir=folder, model_path=model_path, layer_bytes=layer_bytes)
    elif missing := [q for q in types if q not in measured.cpu_flops]:
        logger.info("measuring compute speed for %s (not in the cached profile)", ", ".join(missing))
        _measure_compute(measured, missing, folder)
    else:
        return _profile(name, os_name, measured)
    cache.save(folder, measured)
    return_freed_memory()  # the calibration models' buffers: tens of MiB the process would keep otherwise
    return _profile(name, os_name, measured)


def _profile(name: str, os_name: OsName, m: cache.Measured) -> DeviceProfile:
    """The DeviceProfile from cached speeds and memory read now."""
    backend: Backend = m.fingerprint.backend  # type: ignore[assignment]
    mem = osinfo.read_memory(os_name)
    return DeviceProfile(
        name=name, os=os_name, backend=backend, cpu_count=m.fingerprint.cpu_count,
        cpu_flops=dict(m.cpu_flops), gpu_flops=dict(m.gpu_flops),
        cpu_read_bps=m.cpu_read_bps, gpu_read_bps=m.gpu_read_bps,
        kv_copy_cpu_bps=m.kv_copy_cpu_bps, kv_copy_gpu_bps=m.kv_copy_gpu_bps,
        h2d_bps=m.h2d_bps, d2h_bps=m.d2h_bps, copy_latency_s=m.copy_latency_s,
        unified_memory=gpu.unified_memory(backend, m.fingerprint.machine),
        disk_seq_bps=m.disk_seq_bps, disk_rand_bps=m.disk_rand_bps,
        mem_total_bytes=mem.total_bytes, mem_available_bytes=mem.available_bytes,
        swap_can_bytes=mem.swap_can_bytes, swap_free_bytes=mem.swap_free_bytes,
        metal_working_set_bytes=osinfo.metal_working_set(mem.total_bytes, m.metal_working_set_bytes)
        if backend == "metal" else 0,
        vram_free_bytes=gpu.cuda_free_vram() if backend == "cuda" else 0,
    )


def measure_device(fp: cache.Fingerprint, types: Sequence[str], *, cache_dir: Path,
                   model_path: str | os.PathLike[str] | None = None, layer_bytes: int = 0) -> cache.Measured:
    """Measure everything that is cached: compute, memory, copies and disk."""
    start = time.perf_counter()
    measured = cache.Measured(fingerprint=fp, cpu_flops={})
    _measure_compute(measured, types, cache_dir)

    available = osinfo.read_memory(fp.os).available_bytes  # type: ignore[arg-type]
    size = min(max(layer_bytes, MEMORY_TEST_BYTES[0]), MEMORY_TEST_BYTES[1], max(available // 4, 16 << 20))
    measured.cpu_read_bps = throughput.memory_read_bps(size, threads=fp.cpu_count)
    measured.kv_copy_cpu_bps = throughput.copy_bps(min(size, 64 << 20))
    _measure_gpu_memory(measured)

    disk = _measure_disk(cache_dir, model_path)
    measured.disk_seq_bps, measured.disk_rand_bps = disk.seq_bps, disk.rand_bps
    measured.disk_cache_bypassed = disk.cache_bypassed
    measured.measured_at, measured.seconds = time.time(), time.perf_counter() - start
    logger.info("profiled this device in %.1f s: %s", measured.seconds, measured)
    return measured


def _measure_compute(measured: cache.Measured, types: Sequence[str], cache_dir: Path) -> None:
    backend = measured.fingerprint.backend
    calib = cache_dir / "calibration"
    cpu_tokens = CPU_TOKENS if backend == "cpu" else CPU_TOKENS_GPU_BUILD
    measured.cpu_flops.update(measure_flops(calib, types, n_tokens=cpu_tokens))
    if backend == "cpu":
        return
    try:
        with engine_log() as lines:
            measured.gpu_flops.update(measure_flops(calib, types, gpu=True, n_tokens=GPU_TOKENS))
        # llama.cpp logs it when it first opens Metal in a process: keep an earlier reading when it did not now
        logged = gpu.parse_logged_metal_working_set(lines)
        measured.metal_working_set_bytes = logged or measured.metal_working_set_bytes
    except Exception as e:  # a GPU that fails is left out, not fatal: the device still has its CPU
        logger.warning("could not time the %s GPU, profiling without it: %s", backend, e)


def _measure_gpu_memory(measured: cache.Measured) -> None:
    backend = measured.fingerprint.backend
    if backend == "metal":
        # one memory for both: Python cannot run a Metal kernel without pyobjc, and the GPU reads the same RAM at
        # least as fast as the CPU cores do, so the CPU figures stand in; there are no host<->device copies
        measured.gpu_read_bps, measured.kv_copy_gpu_bps = measured.cpu_read_bps, measured.kv_copy_cpu_bps
    elif backend == "cuda":
        rt = gpu.CudaRuntime.load()
        if rt is None:
            logger.warning("no CUDA runtime library found: host<->device copy speeds left at 0 (unknown)")
            return
        try:
            copies = gpu.measure_cuda_copies(rt)
        except RuntimeError as e:
            logger.warning("could not time CUDA copies, left at 0 (unknown): %s", e)
            return
        measured.h2d_bps, measured.d2h_bps, measured.copy_latency_s = copies.h2d_bps, copies.d2h_bps, copies.latency_s
        measured.gpu_read_bps = measured.kv_copy_gpu_bps = copies.d2d_bps


def _measure_disk(cache_dir: Path, model_path: str | os.PathLike[str] | None) -> throughput.DiskSpeeds:
    if model_path is not None:
        return throughput.disk_read_speeds(Path(model_path), span=DISK_TEST_BYTES)
    # leave room on small devices: never more than a quarter of the free space
    size = min(DISK_TEST_BYTES, shutil.disk_usage(cache_dir).free // 4)
    size -= size % (1 << 20)
    path = throughput.write_test_file(cache_dir / f".disk-test-{os.getpid()}.bin", size)
    try:
        return throughput.disk_read_speeds(path)
    finally:
        path.unlink(missing_ok=True)
