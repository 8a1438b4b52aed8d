"""The profilers: a model's FLOPs and bytes by hand, compute buffers against llama.cpp's own, OS readings from
recorded texts, the device profile's cache, and one real profile of this machine (slow)."""

from __future__ import annotations

import logging
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from primaplug.core.errors import EngineError
from primaplug.core.profiles import QUANT_TYPES, DeviceProfile
from primaplug.engine import ContextSettings, Model, read_layout
from primaplug.memory import android, darwin, resident_bytes, system
from primaplug.profiler import cache, compute, device, gpu, osinfo, throughput
from primaplug.profiler.model import (
    compute_buffer_layers_bytes,
    compute_buffer_output_bytes,
    kv_cells,
    model_types,
    normalise_type,
    profile_model,
)
from tests.conftest import synthetic_path

GiB = 1 << 30

# --- model profiler ----------------------------------------------------------------------------------------------


def test_synthetic_flops_and_bytes_by_hand(model_dir) -> None:
    # conftest's synthetic llama: n_embd 256, n_ff 512, 4 heads of 64, 2 KV heads, vocabulary 512, all Q8_0
    layout = read_layout(synthetic_path(model_dir, "llama", 7, "Q8_0"))
    assert {t.type_name for t in layout.tensors if len(t.shape) == 2} == {"Q8_0"}
    p = profile_model(layout, n_ctx=1000, n_batch=512, n_ubatch=128)
    e, ff, n_kv = 256, 512, 1000
    matmul = 2 * (e * e + e * 128 + e * 128 + e * e + 3 * e * ff)  # q, k, v (2 heads x 64), o, gate, up, down
    attention = 2 * 4 * (64 + 64) * n_kv  # scores and values of 4 heads over the cache
    f32 = 4 * 2 * e + 3 * (256 + 128) + 5 * 4 * n_kv + 2 * e + 5 * ff  # norms, RoPE, softmax, residuals, SwiGLU
    assert p.layer_flops == {"Q8_0": matmul, "F16": attention, "F32": f32}
    assert p.output_flops == {"Q8_0": 2 * e * 512, "F32": 4 * e}
    q8_bytes = matmul // 2 // 32 * 34  # Q8_0: 34 bytes per block of 32 weights
    assert p.layer_bytes == q8_bytes + 2 * e * 4
    assert p.input_bytes == 512 * e // 32 * 34
    assert p.output_bytes == 512 * e // 32 * 34 + e * 4
    assert (p.n_layer, p.n_vocab, p.n_embd, p.n_kv) == (7, 512, 256, 1000)
    assert p.kv_bytes_per_token_layer == 2 * (64 + 64) * 2
    assert p.layer_bytes_with_kv == p.layer_bytes + 512 * 1000
    assert model_types(p) == ("Q8_0", "F16", "F32")


def test_a_mixture_of_experts_token_computes_only_its_experts(model_dir) -> None:
    """conftest's synthetic qwen3moe: 8 experts of 256 rows, 2 a token. A token computes attention, the router and
    2 experts' gate, up and down: the other 6 count in the layer's bytes (memory, disk), not in its compute."""
    layout = read_layout(synthetic_path(model_dir, "qwen3moe", 7, "Q4_K_M"))
    assert (layout.n_expert, layout.n_expert_used) == (8, 2)
    p = profile_model(layout, n_ctx=1000, n_batch=512, n_ubatch=128)
    e, f = 256, 256
    attention = 2 * (e * e + e * 128 + e * 128 + e * e)  # q, k, v (2 heads x 64), o
    router, experts = 2 * e * 8, 2 * 3 * e * f * 2  # scores of all 8 experts (F32); gate, up and down of 2
    assert sum(v for q, v in p.layer_flops.items() if q not in ("F16", "F32")) == attention + experts
    assert p.layer_flops["F32"] > router
    everything = sum(2 * t.shape[0] * t.shape[1] * (t.shape[2] if len(t.shape) == 3 else 1)
                     for t in layout.layer_tensors(0) if len(t.shape) >= 2)
    assert everything == attention + router + 4 * experts  # what counting every expert would have said
    assert p.layer_bytes == round(sum(layout.layer_bytes(il) for il in range(7)) / 7)  # every expert is stored


def test_recurrent_states_count_in_a_layers_memory(model_dir) -> None:
    """Qwen 3.5's gated delta-net layers keep a state a sequence instead of a KV cache: Halda places it with the
    layer, once per sequence and per snapshot a draft rolls back to (head/planning.py)."""
    layout = read_layout(synthetic_path(model_dir, "qwen35", 7, "Q8_0"))
    recurrent = [il for il in range(7) if layout.is_recurrent(il)]
    assert recurrent and layout.recurrent_state_bytes > 0
    p = profile_model(layout, n_ctx=1000, n_batch=512, n_ubatch=128)
    assert p.state_bytes_layer == round(len(recurrent) * layout.recurrent_state_bytes / 7)
    assert p.layer_bytes_with_kv == p.layer_bytes + p.kv_bytes_per_token_layer * 1000 + p.state_bytes_layer
    plain = profile_model(read_layout(synthetic_path(model_dir, "llama", 7, "Q8_0")), n_ctx=1000, n_batch=512,
                          n_ubatch=128)
    assert plain.state_bytes_layer == 0


def test_gemma_profile(gemma_path) -> None:
    layout = read_layout(gemma_path)
    p = profile_model(layout, n_ctx=4096, n_batch=512, n_ubatch=512)
    embd = layout.tensor("token_embd.weight")
    assert layout.output_tied and embd.type_name == "Q8_0"
    # tied embedding: the output layer reads token_embd, and multiplies by it in its type
    assert p.output_bytes == embd.nbytes + 640 * 4 and p.input_bytes == embd.nbytes
    assert p.output_flops["Q8_0"] == 2 * 640 * 262144
    # Gemma's Q5_0 weights (640 is no multiple of 256, so llama.cpp fell back from Q4_K) count as Q5_K
    assert p.layer_flops["Q5_K"] > p.layer_flops["Q4_K"] > 0 and "Q5_0" not in p.layer_flops
    matmuls = sum(2 * t.shape[0] * t.shape[1] for t in layout.tensors if t.layer is not None and len(t.shape) == 2)
    assert sum(p.layer_flops[q] for q in ("Q4_K", "Q5_K", "Q6_K", "Q8_0")) == pytest.approx(matmuls / 18)
    assert p.layer_bytes == round(sum(layout.layer_bytes(il) for il in range(18)) / 18)
    assert p.kv_bytes_per_token_layer == 1 * (256 + 256) * 2
    assert p.compute_buffer_output_bytes == 4 * 512 * (262144 + 3 * 640)


def test_normalise_type() -> None:
    expected = {"Q4_K": "Q4_K", "F32": "F32", "Q4_0": "Q4_K", "Q4_1": "Q4_K", "IQ4_XS": "Q4_K", "Q3_K": "Q4_K",
                "IQ2_XXS": "Q4_K", "MXFP4": "Q4_K", "Q5_0": "Q5_K", "Q5_1": "Q5_K", "Q6_K": "Q6_K", "Q8_1": "Q8_0",
                "Q8_K": "Q8_0", "BF16": "F16", "F64": "F32", "I32": "F32"}
    assert {t: normalise_type(t) for t in expected} == expected
    with pytest.raises(KeyError):
        normalise_type("Q9_Z")


def _logged_compute_buffer(lines: list[str]) -> int:
    pattern = re.compile(r"CPU compute buffer size =\s+([\d.]+) MiB")
    (mib,) = [float(m.group(1)) for line in lines if (m := pattern.search(line))]
    return int(mib * (1 << 20))


@pytest.mark.parametrize(("n_ctx", "n_ubatch"), [(1024, 128), (4096, 512)])
def test_compute_buffer_estimate_against_llama_cpp(gemma_path, model_dir, n_ctx, n_ubatch) -> None:
    for path in (gemma_path, synthetic_path(model_dir, "qwen3", 7, "Q8_0")):
        layout = read_layout(path)
        n = layout.n_layer
        settings = ContextSettings(n_ctx=n_ctx, n_batch=512, n_ubatch=n_ubatch)
        with Model(path, [(0, n)]) as model:
            with compute.engine_log() as lines:
                model.window(0, n, output_hidden=True, settings=settings).close()
            layers = _logged_compute_buffer(lines)
            with compute.engine_log() as lines:
                model.window(n, n, settings=settings).close()
            output = _logged_compute_buffer(lines)
        estimate = compute_buffer_layers_bytes(layout, n_ctx, 512, n_ubatch)
        assert 0.9 * layers <= estimate <= 1.3 * layers, (path.name, estimate / layers)
        assert compute_buffer_output_bytes(layout, n_ctx, 512, n_ubatch) == pytest.approx(output, rel=0.01)


def test_kv_cells_pad_like_llama_cpp() -> None:
    assert (kv_cells(1), kv_cells(256), kv_cells(257), kv_cells(4096)) == (256, 256, 512, 4096)


# --- OS readings -------------------------------------------------------------------------------------------------

MEMINFO = """MemTotal:       24684096 kB
MemFree:        23341564 kB
MemAvailable:   24245044 kB
Active(anon):       1532 kB
Inactive(anon):    52752 kB
Mlocked:           11536 kB
SwapTotal:             0 kB
SwapFree:              0 kB
"""
ANDROID_MEMINFO = """MemTotal:        7662632 kB
MemFree:          193412 kB
MemAvailable:    2411224 kB
Active(anon):    1953280 kB
Inactive(anon):  1210544 kB
Mlocked:          163840 kB
SwapTotal:       4194300 kB
SwapFree:        1835004 kB
"""
V1_CGROUP = "9:name=systemd:/\n4:memory:/process_api/node1\n3:cpuset:/\n0::/\n"
V2_CGROUP = "0::/system.slice/node.service\n"
KiB = 1024


def _reader(files: dict[str, str]):
    return files.get


# The Linux reading is the node's own (memory/system.py: linux_view), which the profile reports (read_memory)
LINUX_TOTAL, LINUX_AVAILABLE = 24684096 * KiB, 24245044 * KiB  # MEMINFO's MemTotal and MemAvailable


def test_linux_memory_without_cgroup_limit() -> None:
    files = {"/sys/fs/cgroup/memory/process_api/node1/memory.limit_in_bytes": "9223372036854771712\n"}
    m = system.linux_view(LINUX_TOTAL, LINUX_AVAILABLE, V1_CGROUP, _reader(files))
    assert (m.total_bytes, m.available_bytes, m.source) == (LINUX_TOTAL, LINUX_AVAILABLE, "system")


def test_cgroup_v1_limit_on_a_parent() -> None:
    base = "/sys/fs/cgroup/memory/process_api"
    files = {
        f"{base}/node1/memory.limit_in_bytes": "9223372036854771712\n",
        f"{base}/memory.limit_in_bytes": str(2 * GiB),
        f"{base}/memory.usage_in_bytes": str(GiB),
        f"{base}/memory.stat": f"cache 300\ntotal_inactive_file {256 << 20}\n",
    }
    m = system.linux_view(LINUX_TOTAL, LINUX_AVAILABLE, V1_CGROUP, _reader(files))
    # the working set is usage less inactive page cache: 1 GiB - 256 MiB
    assert (m.total_bytes, m.available_bytes, m.source) == (2 * GiB, GiB + (256 << 20), "cgroup v1")


def test_cgroup_v2_limit() -> None:
    base = "/sys/fs/cgroup/system.slice/node.service"
    files = {f"{base}/memory.max": f"{4 * GiB}\n", f"{base}/memory.current": f"{3 * GiB}\n",
             f"{base}/memory.stat": f"anon 1000\ninactive_file {GiB}\n",
             "/sys/fs/cgroup/system.slice/memory.max": "max"}
    m = system.linux_view(LINUX_TOTAL, LINUX_AVAILABLE, V2_CGROUP, _reader(files))
    assert (m.total_bytes, m.available_bytes, m.source) == (4 * GiB, 2 * GiB, "cgroup v2")
    # a limit that leaves more than the machine has available is bounded by MemAvailable
    files[f"{base}/memory.max"] = str(23 * GiB)
    files[f"{base}/memory.current"] = "0"
    assert system.linux_view(LINUX_TOTAL, LINUX_AVAILABLE, V2_CGROUP, _reader(files)).available_bytes == \
        LINUX_AVAILABLE
    # "max" everywhere: no limit
    files[f"{base}/memory.max"] = "max\n"
    assert system.linux_view(LINUX_TOTAL, LINUX_AVAILABLE, V2_CGROUP, _reader(files)).source == "system"


def test_android_memory_and_detection(monkeypatch) -> None:
    assert osinfo.android_swap(ANDROID_MEMINFO) == ((1953280 + 1210544 - 163840) * KiB, 1835004 * KiB)
    assert osinfo.android_swap("Active(anon): 10 kB\nMlocked: 20 kB\n") == (0, 0)  # all locked, no swap line
    # available is the node's: MemAvailable less Android's low-memory line (memory/android.py)
    levels = android.default_levels(7662632 * KiB, True)
    view = android.android_view(ANDROID_MEMINFO, levels)
    assert view.available_bytes == 2411224 * KiB - levels.low_memory_bytes() and view.source == "android"
    # which OS: the node's rules (memory/system.py), Termux and Android's own marks told from Linux
    assert system.detect_os("linux", "Linux", {"PREFIX": "/data/data/com.termux/files/usr"}, False) == "android"
    assert system.detect_os("linux", "Linux", {"TERMUX_VERSION": "0.118"}, False) == "android"
    assert system.detect_os("linux", "Linux", {}, True) == "android"
    assert system.detect_os("android", "Android", {}, False) == "android"
    assert system.detect_os("linux", "Linux", {"PREFIX": "/usr"}, False) == "linux"
    assert system.detect_os("darwin", "Darwin", {}, False) == "macos"
    # the profiler refuses an OS Halda does not model
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    with pytest.raises(OSError, match="Windows"):
        osinfo.current_os()
    monkeypatch.setattr(sys, "platform", "android")  # Python 3.13+ on a phone
    monkeypatch.setattr(platform, "system", lambda: "Android")
    assert osinfo.current_os() == "android"


def test_the_profile_reports_the_memory_the_node_budgets(monkeypatch) -> None:
    """read_memory hands on memory_view's figures for the OS asked, and adds Android's swap figures."""
    asked = []

    def view(os_name=None):
        asked.append(os_name)
        return system.MemoryView(8 * GiB, 3 * GiB, "android" if os_name == "android" else "cgroup v2", note="n")

    monkeypatch.setattr(osinfo, "memory_view", view)
    monkeypatch.setattr(osinfo, "read_file", {"/proc/meminfo": ANDROID_MEMINFO}.get)
    assert osinfo.read_memory("android") == osinfo.MemoryReading(
        8 * GiB, 3 * GiB, "android", (1953280 + 1210544 - 163840) * KiB, 1835004 * KiB)
    assert osinfo.read_memory("linux") == osinfo.MemoryReading(8 * GiB, 3 * GiB, "cgroup v2")
    assert asked == ["android", "linux"]


def test_this_machines_profile_memory_is_its_nodes() -> None:
    m, view = osinfo.read_memory(osinfo.current_os()), system.memory_view()
    assert (m.total_bytes, m.source) == (view.total_bytes, view.source)
    assert abs(m.available_bytes - view.available_bytes) < 256 << 20  # moments apart


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12002.
Pages active:                            301478.
Pages inactive:                          290547.
Pages speculative:                         8915.
Pages throttled:                              0.
Pages wired down:                        156296.
Pages purgeable:                          18208.
"Translation faults":                 941066155.
Pages stored in compressor:              593318.
"""


def test_macos_memory_and_metal_working_set(monkeypatch) -> None:
    # the node's macOS rule (memory/darwin.py), vm_stat run by it: free + speculative + purgeable pages where
    # vm_stat prints no file-backed count; inactive pages (other programs' anonymous memory) are not available
    monkeypatch.setattr(darwin, "run_command", lambda argv: VM_STAT if argv == ["vm_stat"] else "1\n")
    m = osinfo.read_memory("macos")
    assert m.available_bytes == (12002 + 8915 + 18208) * 16384 and m.source == "macos"
    assert osinfo.metal_working_set(16 * GiB) == 16 * GiB * 2 // 3
    assert osinfo.metal_working_set(64 * GiB) == 48 * GiB
    logged = ["ggml_metal_device_init: recommendedMaxWorkingSetSize  = 11453.25 MB"]
    assert osinfo.metal_working_set(16 * GiB, gpu.parse_logged_metal_working_set(logged)) == 11453250000
    # with and without Metal: unified memory only on Apple silicon with the Metal backend
    assert gpu.unified_memory("metal", "arm64") and not gpu.unified_memory("cpu", "arm64")
    assert not gpu.unified_memory("metal", "x86_64")


def test_cpu_model() -> None:
    assert osinfo.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n", "x") == "AMD EPYC 7B13"
    arm = "processor\t: 0\nBogoMIPS\t: 38.40\nCPU implementer\t: 0x41\nCPU part\t: 0xd05\n"
    assert osinfo.cpu_model(arm, "aarch64") == "arm implementer 0x41 part 0xd05"
    assert osinfo.cpu_model(None, "aarch64") == "aarch64"


# --- GPU readings (faked: this machine has no GPU) ---------------------------------------------------------------


def test_backend_from_engine_libraries() -> None:
    assert gpu.detect_backend(["libllama.so", "libggml-cpu.so", "libggml-cuda.so.0"]) == "cuda"
    assert gpu.detect_backend(["libllama.dylib", "libggml-metal.dylib", "libggml-blas.dylib"]) == "metal"
    assert gpu.detect_backend(["libllama.so", "libggml-cpu.so"]) == "cpu"
    assert gpu.detect_backend(gpu.engine_lib_names()) == "cpu"  # this machine's engine build
    assert any(n.startswith("libllama") for n in gpu.engine_lib_names())


def test_cuda_free_vram() -> None:
    assert gpu.parse_nvidia_smi_free("23456\n1024\n") == 23456 << 20
    with pytest.raises(ValueError):
        gpu.parse_nvidia_smi_free("NVIDIA-SMI has failed because it couldn't communicate with the driver.\n")

    def smi(args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout="81003\n", stderr="")

    def no_smi(args, **kwargs):
        raise FileNotFoundError(args[0])

    class Runtime:
        def mem_get_info(self) -> tuple[int, int]:
            return 7 * GiB, 8 * GiB

    assert gpu.cuda_free_vram(run=smi) == 81003 << 20
    assert gpu.cuda_free_vram(run=no_smi, runtime=Runtime) == 7 * GiB  # Jetson: no nvidia-smi
    assert gpu.cuda_free_vram(run=no_smi, runtime=lambda: None) == 0
    line = "llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H100 80GB HBM3) (0000:00:07.0) - 80614 MiB free"
    assert gpu.parse_logged_vram_free(["other", line]) == 80614 << 20


class FakeCuda:
    """Copies take latency + bytes / speed on a fake clock."""

    def __init__(self) -> None:
        self.now, self.freed = 0.0, []
        self.speed = {gpu.H2D: 20e9, gpu.D2H: 25e9, gpu.D2D: 1e12}

    def clock(self) -> float:
        return self.now

    def malloc(self, nbytes: int) -> int:
        return 0x1000 * (len(self.freed) + 1)

    def free(self, ptr: int) -> None:
        self.freed.append(ptr)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self.now += 10e-6 + nbytes / self.speed[kind]

    def mem_get_info(self) -> tuple[int, int]:
        return GiB, 2 * GiB


def test_cuda_copy_speeds_from_fake_runtime() -> None:
    rt = FakeCuda()
    c = gpu.measure_cuda_copies(rt, small=16 << 10, large=64 << 20, clock=rt.clock)
    small = 16 << 10
    assert c.latency_s == pytest.approx(10e-6 + (small / 20e9 + small / 25e9) / 2)
    assert c.h2d_bps == pytest.approx(20e9, rel=1e-3) and c.d2h_bps == pytest.approx(25e9, rel=1e-3)
    assert c.d2d_bps == pytest.approx(2 * (64 << 20) / (10e-6 + (64 << 20) / 1e12))
    assert len(rt.freed) == 2


# --- compute speed: solving mixed timings ------------------------------------------------------------------------


def test_solve_speeds_recovers_known_speeds() -> None:
    true = {"Q4_K": 80e9, "F16": 50e9, "F32": 20e9}
    flops = {"Q4_K": {"Q4_K": 9e9, "F16": 4e8, "F32": 1e7, "Q6_K": 1e8},  # Q6_K has no file: counted as Q4_K
             "F16": {"F16": 9.4e9, "F32": 1e7}, "F32": {"F32": 9e9, "F16": 4e8}}
    seconds = {f: sum(v / true["Q4_K" if q == "Q6_K" else q] for q, v in row.items()) for f, row in flops.items()}
    solved = compute.solve_speeds(flops, seconds)
    assert solved == pytest.approx(true)
    # timings no speeds can explain (the F16 file took less time than its F32 part alone needs): each file's
    # total over its time instead
    seconds["F16"] = 1e-4
    assert compute.solve_speeds(flops, seconds)["F16"] == pytest.approx(9.41e9 / 1e-4)


@pytest.fixture(scope="session")
def calibration_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("profiles")
    compute.calibration_models(folder / "calibration", QUANT_TYPES)
    return folder


def test_calibration_models_are_one_type_each(calibration_dir) -> None:
    models = compute.calibration_models(calibration_dir / "calibration", QUANT_TYPES)
    assert set(models) == set(QUANT_TYPES)
    for q, path in models.items():
        matmuls = {t.type_name for t in read_layout(path).layer_tensors(0) if len(t.shape) == 2}
        assert matmuls == {q}, (q, matmuls)
        flops = compute.forward_flops(path, 64)
        assert flops[q] > 0.9 * sum(flops.values())  # its own type dominates: the system is well conditioned


def test_gpu_path_with_a_fake_timer(calibration_dir) -> None:
    true = {"Q4_K": 900e12, "Q5_K": 800e12, "Q6_K": 700e12, "Q8_0": 600e12, "F16": 500e12, "F32": 60e12}
    calls = []

    def timer(paths: list[Path], n_tokens: int, repeats: int, on_gpu: bool) -> list[float]:
        calls.append(on_gpu)
        return [sum(f / true[q] for q, f in compute.forward_flops(p, n_tokens).items()) for p in paths]

    speeds = compute.measure_flops(calibration_dir / "calibration", ["Q4_K", "Q8_0"], gpu=True, n_tokens=256,
                                   timer=timer)
    assert set(speeds) == {"Q4_K", "Q8_0", "F16", "F32"} and calls == [True]
    assert speeds == pytest.approx({q: true[q] for q in speeds})


def test_device_gpu_paths_with_fakes(monkeypatch, tmp_path) -> None:
    calls = []

    def measure_flops(folder, types, *, gpu=False, n_tokens=64):
        calls.append((gpu, n_tokens))
        if gpu:  # what llama.cpp logs when it opens a Metal device
            logging.getLogger("primaplug.llama").debug("ggml_metal_device_init: recommendedMaxWorkingSetSize  = "
                                                       "11453.25 MB")
        return {q: 2e12 if gpu else 1e11 for q in types}

    monkeypatch.setattr(device, "measure_flops", measure_flops)
    monkeypatch.setattr(gpu.CudaRuntime, "load", classmethod(lambda cls: FakeCuda()))
    monkeypatch.setattr(gpu, "measure_cuda_copies", lambda rt: gpu.CopySpeeds(2e10, 2.5e10, 1e-5, 2e12))
    monkeypatch.setattr(gpu, "cuda_free_vram", lambda: 40 * GiB)
    monkeypatch.setattr(osinfo, "read_memory", lambda os_name: osinfo.MemoryReading(16 * GiB, 9 * GiB, "test"))

    cuda = cache.Measured(fingerprint=_fp(backend="cuda"), cpu_flops={}, cpu_read_bps=3e10)
    device._measure_compute(cuda, ["Q4_K", "F16", "F32"], tmp_path)
    device._measure_gpu_memory(cuda)
    # the CPU of a GPU build is timed below the op-offload batch size
    assert calls == [(False, device.CPU_TOKENS_GPU_BUILD), (True, device.GPU_TOKENS)]
    p = device._profile("box", "linux", cuda)
    assert p.backend == "cuda" and p.has_gpu and p.gpu_flops["Q4_K"] == 2e12 and p.cpu_flops["Q4_K"] == 1e11
    assert (p.h2d_bps, p.d2h_bps, p.copy_latency_s, p.gpu_read_bps) == (2e10, 2.5e10, 1e-5, 2e12)
    assert p.vram_free_bytes == 40 * GiB and not p.unified_memory and p.metal_working_set_bytes == 0

    metal = cache.Measured(fingerprint=_fp(backend="metal", os="macos", machine="arm64"), cpu_flops={},
                           cpu_read_bps=6e10, kv_copy_cpu_bps=3e10)
    device._measure_compute(metal, ["Q4_K", "F16", "F32"], tmp_path)
    device._measure_gpu_memory(metal)
    p = device._profile("mac", "macos", metal)
    assert p.unified_memory and p.metal_working_set_bytes == 11453250000 and p.vram_free_bytes == 0
    assert (p.gpu_read_bps, p.kv_copy_gpu_bps, p.h2d_bps, p.d2h_bps) == (6e10, 3e10, 0.0, 0.0)

    # a GPU that fails to run is left out; the CPU figures stay
    def failing(folder, types, *, gpu=False, n_tokens=64):
        if gpu:
            raise EngineError("could not create window [0, 1)")
        return {q: 1e11 for q in types}

    monkeypatch.setattr(device, "measure_flops", failing)
    broken = cache.Measured(fingerprint=_fp(backend="cuda"), cpu_flops={})
    device._measure_compute(broken, ["F16", "F32"], tmp_path)
    assert broken.gpu_flops == {} and broken.cpu_flops == {"F16": 1e11, "F32": 1e11}


# --- the cache ---------------------------------------------------------------------------------------------------


def _fp(**change) -> cache.Fingerprint:
    base = dict(cpu_model="Test CPU", cpu_count=2, mem_total_bytes=8 * GiB, os="linux", kernel="6.1", machine="x86_64",
                engine="0.3.36+primaplug.abc", backend="cpu", cgroup="0::/", disk="254:0")
    return cache.Fingerprint(**{**base, **change})


@pytest.fixture
def fake_measuring(monkeypatch):
    """profile_device with measuring replaced by counters and a controllable fingerprint and memory."""
    state = {"fp": _fp(), "measured": 0, "compute": [], "available": 5 * GiB}

    def measure_device(fp, types, **kwargs):
        state["measured"] += 1
        return cache.Measured(fingerprint=fp, cpu_flops={q: 1e9 * (i + 1) for i, q in enumerate(types)},
                              cpu_read_bps=2e10, disk_seq_bps=1e9, measured_at=float(state["measured"]))

    def measure_compute(measured, types, cache_dir):
        state["compute"].append(tuple(types))
        measured.cpu_flops.update({q: 7e9 for q in types})

    monkeypatch.setattr(device, "fingerprint", lambda os_name, backend, disk: state["fp"])
    monkeypatch.setattr(device, "measure_device", measure_device)
    monkeypatch.setattr(device, "_measure_compute", measure_compute)
    monkeypatch.setattr(osinfo, "read_memory",
                        lambda os_name: osinfo.MemoryReading(8 * GiB, state["available"], "meminfo"))
    return state


def test_cache_reuses_speeds_and_reads_memory_fresh(fake_measuring, tmp_path) -> None:
    first = device.profile_device("a", cache_dir=tmp_path)
    assert fake_measuring["measured"] == 1 and first.mem_available_bytes == 5 * GiB
    fake_measuring["available"] = 3 * GiB
    second = device.profile_device("b", cache_dir=tmp_path)
    assert fake_measuring["measured"] == 1  # not measured again
    assert second.cpu_flops == first.cpu_flops and second.cpu_read_bps == 2e10
    assert (second.name, second.mem_available_bytes) == ("b", 3 * GiB)  # memory is read fresh

    device.profile_device("c", cache_dir=tmp_path, force=True)
    assert fake_measuring["measured"] == 2


def test_cache_remeasures_when_the_fingerprint_changes(fake_measuring, tmp_path) -> None:
    device.profile_device("a", cache_dir=tmp_path)
    for change in ({"engine": "0.3.37+primaplug.def"}, {"kernel": "6.8"}, {"cgroup": "4:memory:/node2"},
                   {"mem_total_bytes": 16 * GiB}):
        fake_measuring["fp"] = _fp(**change)
        before = fake_measuring["measured"]
        device.profile_device("a", cache_dir=tmp_path)
        device.profile_device("a", cache_dir=tmp_path)
        assert fake_measuring["measured"] == before + 1, change
    # a corrupt cache file is measured again, not trusted
    cache.cache_path(tmp_path, fake_measuring["fp"]).write_text("{not json")
    device.profile_device("a", cache_dir=tmp_path)
    assert fake_measuring["measured"] == 6


def test_cache_measures_only_new_quant_types(fake_measuring, tmp_path) -> None:
    device.profile_device("a", cache_dir=tmp_path, model_types=["Q4_K", "F32"])
    assert fake_measuring["compute"] == []
    p = device.profile_device("a", cache_dir=tmp_path, model_types=["Q4_K", "Q8_0", "F16", "F32"])
    assert fake_measuring["measured"] == 1 and fake_measuring["compute"] == [("Q8_0",)]
    assert p.cpu_flops["Q8_0"] == 7e9 and p.cpu_flops["Q4_K"] == 1e9
    stored = msgspec.json.decode(cache.cache_path(tmp_path, fake_measuring["fp"]).read_bytes(), type=cache.Measured)
    assert set(stored.cpu_flops) == {"Q4_K", "Q8_0", "F16", "F32"}
    with pytest.raises(ValueError, match="Q5_0"):
        device.profile_device("a", cache_dir=tmp_path, model_types=["Q5_0"])


# --- disk reads --------------------------------------------------------------------------------------------------


def test_random_reads_shape() -> None:
    reads = throughput.random_reads(64 << 20, 16 << 20, seed=1)
    assert sum(n for _, n in reads) >= 16 << 20
    assert all(n in [4096 << k for k in range(9)] and off % 4096 == 0 and off + n <= 64 << 20 for off, n in reads)
    assert len({n for _, n in reads}) > 4  # a spread of sizes


def test_disk_reads_leave_the_file_uncached(tmp_path) -> None:
    path = throughput.write_test_file(tmp_path / "disk.bin", 16 << 20)
    speeds = throughput.disk_read_speeds(path, rand_total=4 << 20, repeats=1)
    assert speeds.seq_bps > 0 and speeds.rand_bps > 0
    if speeds.cache_bypassed and hasattr(os, "posix_fadvise"):
        assert resident_bytes(path, [(0, 16 << 20)]) <= (16 << 20) // 100


# --- the real thing ----------------------------------------------------------------------------------------------


def test_profile_this_machine(calibration_dir) -> None:
    p = device.profile_device("ci", cache_dir=calibration_dir)
    assert isinstance(p, DeviceProfile) and p.os == "linux" and p.backend == "cpu" and p.cpu_count >= 1
    assert set(p.cpu_flops) == set(QUANT_TYPES)
    for q, s in p.cpu_flops.items():
        assert math.isfinite(s) and 1e8 < s < 1e14, (q, s)  # 0.1 GFLOP/s .. 100 TFLOP/s
    assert 1e8 < p.cpu_read_bps < 1e12 and 1e8 < p.kv_copy_cpu_bps < 1e12
    assert 1e6 < p.disk_seq_bps < 1e11 and 1e5 < p.disk_rand_bps < 1e11
    assert 0 < p.mem_available_bytes <= p.mem_total_bytes
    assert p.gpu_flops == {} and not p.unified_memory and p.vram_free_bytes == 0
    # the second call takes the speeds from the cache
    again = device.profile_device("ci", cache_dir=calibration_dir)
    assert again.cpu_flops == p.cpu_flops and again.disk_seq_bps == p.disk_seq_bps


@pytest.mark.parametrize("k", [1, 2, 4])
def test_node_reserve_and_scheduler_count_the_same_compute_buffers(model_dir, k: int) -> None:
    """A node reserves, beside its KV cache, one compute buffer sized for a prompt and the one-token part of it for
    every further window (windows give their buffers back after a prompt); Halda's RAM need must count the same,
    or it plans windows the node cannot hold."""
    from primaplug.core.windows import LayerRange
    from primaplug.device import reserved_bytes
    from primaplug.scheduler.latency import platform

    layout = read_layout(synthetic_path(model_dir, "llama", 9, "Q8_0"))
    n_ctx, n_batch, n_ubatch = 512, 64, 32
    windows = [LayerRange(2 * r, 2 * r + 1) for r in range(k)]
    kv = sum(layout.kv_bytes_per_token(w.start) * n_ctx for w in windows)
    node = reserved_bytes(layout, windows, n_ctx, n_batch, n_ubatch) - kv
    mp = profile_model(layout, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch)
    peer = DeviceProfile(name="peer", os="linux", cpu_flops={q: 1e11 for q in QUANT_TYPES},
                         mem_available_bytes=1 << 30)
    p = platform([peer, peer], mp)
    assert (p.ram_fixed(k) - p.ram_head)[1] == node
    assert node == compute_buffer_layers_bytes(layout, n_ctx, n_batch, n_ubatch) + \
        (k - 1) * compute_buffer_layers_bytes(layout, n_ctx, 1, 1)


def test_a_cgroup_whose_caps_change_is_another_device() -> None:
    """The profile cache's key holds each cgroup's caps, not only its path: an emulated device given other caps in
    the same group is measured again (its cached speeds were another device's)."""
    from primaplug.profiler.osinfo import cgroup_identity

    files = {"/proc/self/cgroup": "5:memory:/dev1\n4:cpu:/dev1\n0::/dev1\n",
             "/sys/fs/cgroup/memory/dev1/memory.limit_in_bytes": "209715200\n",
             "/sys/fs/cgroup/cpu/dev1/cpu.cfs_quota_us": "32000", "/sys/fs/cgroup/cpu/dev1/cpu.cfs_period_us": "100000"}
    first = cgroup_identity(files.get)
    assert "memory.limit_in_bytes=209715200" in first and "cpu.cfs_quota_us=32000" in first
    files["/sys/fs/cgroup/cpu/dev1/cpu.cfs_quota_us"] = "64000"
    assert cgroup_identity(files.get) != first
    v2 = {"/proc/self/cgroup": "0::/dev2\n", "/sys/fs/cgroup/dev2/memory.max": "max", "/sys/fs/cgroup/dev2/cpu.max":
          "50000 100000"}
    assert cgroup_identity(v2.get).endswith("memory.max=max;cpu.max=50000 100000")
    assert cgroup_identity({}.get) == ""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")
def test_the_memory_tests_leave_nothing_resident() -> None:
    """A small device's memory tests (buffers under glibc's 32 MiB mapping threshold), run off the main thread as a
    node profiles: from malloc, their buffers stayed in the thread's arena for good (53 MiB of a 145 MiB phone)."""
    code = """
import threading
from primaplug.profiler import throughput
def anon():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon"))
before = anon()
def work():
    throughput.memory_read_bps(26 << 20, threads=2, repeats=1)
    throughput.copy_bps(26 << 20, repeats=1)
t = threading.Thread(target=work)
t.start()
t.join()
print(anon() - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 8 << 20, f"{int(out.stdout.split()[-1]) >> 20} MiB left after the tests"
