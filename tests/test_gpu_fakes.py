"""Every code path that handles GPU layers, on a machine without a GPU: fakes stand in for the GPU only (an engine lib
folder with libggml-cuda in it, nvidia-smi on PATH, a CUDA runtime, llama.cpp finding a GPU device), everything else
is real: the profiler, the scheduler, the wire, a node's validation and deployment, the engine's placement map, the
head's windows and a re-formed ring. docs/gpu.md says what is tested here and what needs a real GPU
(tests/test_gpu_layers.py)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from primaplug.core.errors import ConfigError, EngineError, NodeError
from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.core.windows import LayerRange
from primaplug.profiler import cache, device, gpu, osinfo

GiB = 1 << 30
CUDA_LIBS = ["libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so", "libggml-cuda.so", "libggml-cuda.so.0"]
METAL_LIBS = ["libllama.dylib", "libggml.dylib", "libggml-cpu.dylib", "libggml-metal.dylib", "libggml-blas.dylib"]
CPU_LIBS = ["libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so"]
ROOT = Path(__file__).resolve().parents[1]


def fake_lib_folder(folder: Path, names: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"")  # names only: nothing ever loads them
    return folder


@pytest.fixture
def engine_libs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """engine_libs(names): the engine's lib folder, as primaplug reads it, becomes a fake one holding these files
    (through LLAMA_CPP_LIB_PATH, which llama-cpp-python's loader honours too: a test that loads the engine imports
    it first, so that the real one is loaded)."""

    def use(names: list[str]) -> None:
        folder = fake_lib_folder(tmp_path / f"lib{len(list(tmp_path.glob('lib*')))}", names)
        monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(folder))

    return use


# --- the profiler: the backend, free VRAM, the CUDA runtime -----------------------------------------------------------


def test_the_backend_is_read_off_a_fake_engine_lib_folder(engine_libs) -> None:
    for names, backend in ((CUDA_LIBS, "cuda"), (METAL_LIBS, "metal"), (CPU_LIBS, "cpu")):
        engine_libs(names)
        assert gpu.engine_backend() == backend, names
    engine_libs([])
    assert gpu.engine_lib_names() == [] and gpu.engine_backend() == "cpu"


def test_the_backend_of_a_fake_llama_cpp_package(tmp_path: Path) -> None:
    """Without LLAMA_CPP_LIB_PATH the lib folder is found beside the llama_cpp package, without importing it."""
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the fake llama_cpp must not be imported')\n")
    fake_lib_folder(package / "lib", CUDA_LIBS)
    env = {k: v for k, v in __import__("os").environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{ROOT}"
    code = ("from primaplug.profiler import gpu; "
            "print(gpu.engine_backend(), 'libggml-cuda.so' in gpu.engine_lib_names())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda", "True"]


def fake_nvidia_smi(folder: Path, script: str) -> Path:
    """An executable nvidia-smi in `folder` running `script` (sh); its arguments are appended to folder/args."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" f'echo "$@" >> "{folder}/args"\n' + textwrap.dedent(script))
    exe.chmod(0o755)
    return folder


class Runtime:
    """A CUDA runtime (profiler.gpu.Runtime) that reads `free` or, like libcudart without a device or a driver,
    fails."""

    def __init__(self, free: int = 7 * GiB, error: int = 0) -> None:
        self.free_bytes, self.error = free, error

    def malloc(self, nbytes: int) -> int:
        raise AssertionError("not used here")

    def free(self, ptr: int) -> None:
        raise AssertionError("not used here")

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        raise AssertionError("not used here")

    def mem_get_info(self) -> tuple[int, int]:
        if self.error:
            raise RuntimeError(f"cudaMemGetInfo failed with CUDA error {self.error}")
        return self.free_bytes, 8 * GiB


def test_free_vram_from_a_fake_nvidia_smi_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # two GPUs; CUDA's device 0 is the first one CUDA_VISIBLE_DEVICES names, which nvidia-smi does not read
    bin_ = fake_nvidia_smi(tmp_path / "bin", """\
        case "$*" in
          *--id=1*) echo 1024 ;;
          *--id=GPU-abc*) echo 2048 ;;
          *) printf '81003\\n1024\\n' ;;
        esac
        """)
    monkeypatch.setenv("PATH", f"{bin_}:{__import__('os').environ['PATH']}")
    unused = Runtime(error=999)  # nvidia-smi answers: the runtime is not asked
    assert gpu.cuda_free_vram(runtime=lambda: unused, env={}) == 81003 << 20
    assert gpu.cuda_free_vram(runtime=lambda: unused, env={"CUDA_VISIBLE_DEVICES": "1,0"}) == 1024 << 20
    assert gpu.cuda_free_vram(runtime=lambda: unused, env={"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == 2048 << 20
    calls = (bin_ / "args").read_text().splitlines()
    assert len(calls) == 3 and all("--query-gpu=memory.free" in c for c in calls) and "--id=1" in calls[1]
    # every device hidden: no GPU for the plan, and nvidia-smi is not asked about the ones CUDA cannot see
    for hidden in ("", "-1", " , 0"):
        assert gpu.cuda_free_vram(runtime=lambda: unused, env={"CUDA_VISIBLE_DEVICES": hidden}) == 0
    assert len((bin_ / "args").read_text().splitlines()) == 3


def test_free_vram_when_nvidia_smi_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_ = fake_nvidia_smi(tmp_path / "bin", """\
        echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
        exit 9
        """)
    monkeypatch.setenv("PATH", f"{bin_}:{__import__('os').environ['PATH']}")
    assert gpu.cuda_free_vram(runtime=lambda: Runtime(free=3 * GiB), env={}) == 3 * GiB  # a Jetson: the runtime
    # a CUDA toolkit on a machine without a GPU (cudaErrorNoDevice) or without a driver (cudaErrorInsufficientDriver):
    # no VRAM, not a failed profile
    assert gpu.cuda_free_vram(runtime=lambda: Runtime(error=100), env={}) == 0
    assert gpu.cuda_free_vram(runtime=lambda: Runtime(error=35), env={}) == 0
    assert gpu.cuda_free_vram(runtime=lambda: None, env={}) == 0  # no runtime library either


FAKE_CUDART = r"""
#include <stdlib.h>
#include <string.h>
int fake_error = 0;  /* returned by every call when set: 100 is cudaErrorNoDevice */
int fake_live = 0;   /* allocations not freed */
int fake_syncs = 0;
size_t fake_free = 7ull << 30, fake_total = 8ull << 30;
int cudaMalloc(void **p, size_t n) { if (fake_error) return fake_error; *p = malloc(n); if (!*p) return 2;
                                     fake_live++; return 0; }
int cudaFree(void *p) { if (p) { free(p); fake_live--; } return 0; }
int cudaMemcpy(void *d, const void *s, size_t n, int kind) { if (fake_error) return fake_error;
                                                              if (kind < 1 || kind > 3) return 21;
                                                              memcpy(d, s, n); return 0; }
int cudaMemGetInfo(size_t *f, size_t *t) { if (fake_error) return fake_error; *f = fake_free; *t = fake_total;
                                           return 0; }
int cudaDeviceSynchronize(void) { fake_syncs++; return 0; }
"""


@pytest.fixture
def fake_cudart(tmp_path: Path) -> ctypes.CDLL:
    """A libcudart.so whose "device memory" is host memory: CudaRuntime's ctypes calls run for real."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake CUDA runtime")
    src, lib = tmp_path / "fake_cudart.c", tmp_path / "libcudart.so"
    src.write_text(FAKE_CUDART)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def test_the_cuda_runtime_through_ctypes_on_a_fake_libcudart(fake_cudart: ctypes.CDLL) -> None:
    rt = gpu.CudaRuntime(fake_cudart)
    assert rt.mem_get_info() == (7 * GiB, 8 * GiB)
    host = np.arange(4096, dtype=np.uint8)
    back = np.zeros_like(host)
    dev = rt.malloc(host.nbytes)
    assert dev != 0
    rt.memcpy(dev, host.ctypes.data, host.nbytes, gpu.H2D)
    rt.memcpy(back.ctypes.data, dev, host.nbytes, gpu.D2H)
    rt.free(dev)
    assert np.array_equal(back, host)  # the pointers and sizes went through ctypes as they should
    assert ctypes.c_int.in_dll(fake_cudart, "fake_syncs").value == 2  # every copy waits for the device
    with pytest.raises(RuntimeError, match="cudaMemcpy failed with CUDA error 21"):
        rt.memcpy(back.ctypes.data, host.ctypes.data, 16, 7)

    c = gpu.measure_cuda_copies(rt, small=4 << 10, large=1 << 20, repeats=2)
    assert all(np.isfinite(x) and x > 0 for x in (c.h2d_bps, c.d2h_bps, c.d2d_bps))
    assert ctypes.c_int.in_dll(fake_cudart, "fake_live").value == 0  # both device buffers freed

    ctypes.c_int.in_dll(fake_cudart, "fake_error").value = 100  # no device
    with pytest.raises(RuntimeError, match="cudaMalloc failed with CUDA error 100"):
        gpu.measure_cuda_copies(rt, small=4 << 10, large=1 << 20)
    assert gpu.cuda_free_vram(run=_no_nvidia_smi, runtime=lambda: rt, env={}) == 0


def _no_nvidia_smi(args: list[str], **_: object) -> subprocess.CompletedProcess[str]:
    raise FileNotFoundError(args[0])


def _fp(**change: object) -> cache.Fingerprint:
    base = dict(cpu_model="Test CPU", cpu_count=8, mem_total_bytes=32 * GiB, os="linux", kernel="6.1",
                machine="x86_64", engine="0.3.36", backend="cpu", cgroup="0::/", disk="254:0")
    return cache.Fingerprint(**{**base, **change})  # type: ignore[arg-type]


def test_a_cuda_profile_reads_vram_through_a_fake_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_ = fake_nvidia_smi(tmp_path / "bin", "echo 12288\n")
    monkeypatch.setenv("PATH", f"{bin_}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(osinfo, "read_memory", lambda os_name: osinfo.MemoryReading(32 * GiB, 20 * GiB, "test"))
    measured = cache.Measured(fingerprint=_fp(backend="cuda"), cpu_flops={"Q4_K": 1e11}, gpu_flops={"Q4_K": 2e12})
    p = device._profile("box", "linux", measured)
    assert p.backend == "cuda" and p.has_gpu and p.vram_free_bytes == 12288 << 20
    assert device._profile("box", "linux", cache.Measured(fingerprint=_fp(), cpu_flops={})).vram_free_bytes == 0


# --- the scheduler: which layers go on a GPU -------------------------------------------------------------------------


def _model(n_layer: int = 12) -> ModelProfile:
    return ModelProfile(name="m", n_layer=n_layer, n_vocab=1000, n_embd=1024, layer_bytes=500_000_000,
                        input_bytes=100_000_000, output_bytes=200_000_000, layer_flops={"Q4_K": 1e9, "F32": 1e7},
                        output_flops={"Q4_K": 5e8}, kv_bytes_per_token_layer=2048, n_kv=4096,
                        compute_buffer_cpu_bytes=100_000_000, compute_buffer_gpu_bytes=150_000_000)


def _device(name: str, backend: str = "cpu", *, os: str = "linux", vram_gb: float = 0, ram_gb: float = 8,
            metal_gb: float = 0) -> DeviceProfile:
    gpu_ = backend != "cpu"
    return DeviceProfile(
        name=name, os=os, backend=backend, cpu_flops={"Q4_K": 1e11, "F32": 3e10},  # type: ignore[arg-type]
        gpu_flops={"Q4_K": 2e12} if gpu_ else {}, cpu_read_bps=2e10, gpu_read_bps=2e11 if gpu_ else 0,
        kv_copy_cpu_bps=5e9, kv_copy_gpu_bps=5e10 if gpu_ else 0, h2d_bps=1e10 if backend == "cuda" else 0,
        d2h_bps=1e10 if backend == "cuda" else 0, copy_latency_s=2e-5, unified_memory=backend == "metal",
        disk_seq_bps=2e9, disk_rand_bps=1e9, mem_total_bytes=int(2 * ram_gb * GiB),
        mem_available_bytes=int(ram_gb * GiB), vram_free_bytes=int(vram_gb * GiB),
        metal_working_set_bytes=int(metal_gb * GiB), link_latency_s=4e-3, link_bps=5e7)


@pytest.mark.parametrize("scheduler", ["halda", "memory", "compute"])
def test_a_gpu_with_no_free_vram_gets_no_layers(scheduler: str) -> None:
    from primaplug.scheduler import solve

    def plan(vram_gb: float):
        devices = [_device("head", "cuda", vram_gb=vram_gb), _device("a", "cuda", vram_gb=vram_gb), _device("b")]
        return solve(devices, _model(), scheduler=scheduler, latency_model="ring")  # type: ignore[arg-type]

    with_vram = plan(8)
    assert sum(d.n for d in with_vram.devices) > 0  # the same devices with VRAM do get GPU layers
    without = plan(0)  # nvidia-smi and the runtime read nothing: 0 is what the profile says
    assert [d.n for d in without.devices] == [0] * len(without.devices)
    assert all(d.vram_bytes == 0 for d in without.devices)


def test_a_split_by_hand_asks_only_for_gpu_layers_a_node_can_hold() -> None:
    from primaplug.scheduler import check_gpu_layers, placement

    model = _model()
    cpu = [_device("head"), _device("a"), _device("b")]
    with pytest.raises(ValueError, match=r"a's engine has no GPU backend \(built for cpu\).*-ngl 0"):
        check_gpu_layers(cpu, model, [6, 6], [2, 0])
    check_gpu_layers(cpu, model, [6, 6], [0, 0])  # nothing asked: nothing to refuse
    # placement() itself scores what it is given (the dashboard draws it): the check is the coordinator's
    assert placement(cpu, model, [6, 6], gpu_layers=[2, 0]).device("a").n == 2

    # 1.2 GiB free: room for two layers of 0.5 GB (and their KV) beside a 150 MB compute buffer per window
    small = [_device("head"), _device("a", "cuda", vram_gb=1.2), _device("b", "cuda", vram_gb=0)]
    check_gpu_layers(small, model, [6, 6], [2, 0])
    with pytest.raises(ValueError, match=r"a's GPU holds 2 of its layers per window with 1 round\(s\), not 3: "
                                         r"1\.20 GiB free.*lower -ngl to 2"):
        check_gpu_layers(small, model, [6, 6], [3, 0])
    with pytest.raises(ValueError, match=r"b's GPU holds 0 .* not 1: 0\.00 GiB free"):
        check_gpu_layers(small, model, [6, 6], [0, 1])
    # two rounds: every window has its own compute buffer and the VRAM holds both rounds' GPU layers
    with pytest.raises(ValueError, match="holds 0 of its layers per window with 2 round"):
        check_gpu_layers(small, model, [3, 3], [1, 0], rounds=2)
    # a window smaller than -ngl asks only for its own layers
    check_gpu_layers(small, model, [2, 10], [5, 0])
    # Metal on a Mac holds layers in its working set; a Metal build elsewhere cannot
    mac = [_device("head"), _device("m", "metal", os="macos", metal_gb=6)]
    check_gpu_layers(mac, model, [12], [4])
    odd = [_device("head"), _device("m", "metal", os="linux")]
    with pytest.raises(ValueError, match="m's metal backend cannot run layers on linux"):
        check_gpu_layers(odd, model, [12], [4])


def test_the_dashboard_refuses_gpu_layers_a_node_cannot_hold(gemma_path: Path) -> None:
    from primaplug.head.coordinator import Coordinator, PlanRequest
    from primaplug.head.planning import Measured

    model = _model(18)
    devices = (_device("head"), _device("node1", "cuda", vram_gb=24), _device("node2"))
    c = Coordinator(gemma_path, ["127.0.0.1:7000", "127.0.0.1:7010"])
    try:
        for e, name in zip(c.nodes.values(), ("node1", "node2"), strict=True):
            e.own, e.name = name, name
        c.measured = Measured(model, devices, 4e-3, 5e7)
        with pytest.raises(ConfigError, match=r"node2's engine has no GPU backend \(built for cpu\)"):
            c.plan(PlanRequest("even", gpu_layers=2))
        c.remove("127.0.0.1:7010")  # node1 alone: its GPU holds them
        choice = c.plan(PlanRequest("even", gpu_layers=2))
        assert choice.plan.device("node1").n == 2 and choice.plan.device("node1").vram_bytes > 0
    finally:
        c.close()


def test_the_dashboard_deploys_a_head_alone_with_its_gpu_layers(gemma_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.head import llama
    from primaplug.head.coordinator import Coordinator
    from primaplug.head.planning import Measured
    from primaplug.scheduler import solve

    calls: list[dict[str, object]] = []

    class FakeLlama:  # the deployment itself is tested above: here, what the coordinator asks of it
        def __init__(self, path: object, **kwargs: object) -> None:
            calls.append(kwargs)

    monkeypatch.setattr(llama, "Llama", FakeLlama)
    model = _model(18)
    c = Coordinator(gemma_path, [])
    try:
        for head, expected in ((_device("head", "cuda", vram_gb=24), True), (_device("head"), False)):
            c.measured = Measured(model, (head,), 4e-3, 5e7)
            plan = solve([head], model, latency_model="ring")
            c.deploy(plan)
            kwargs = calls[-1]
            if expected:  # the plan's windows, and the first n of each on the head's GPU
                assert plan.head.n > 0 and kwargs["node_gpu_layers"] == plan.head.n
                assert kwargs["layers"] == [plan.head.w] and kwargs["rounds"] == plan.k
            else:  # no GPU layers: one window, as before
                assert "node_gpu_layers" not in kwargs and kwargs["layers"] == [18]
            c.llm = None
    finally:
        c.close()


def test_the_dashboard_draws_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.tui.render import profile_cells, profile_detail

    p = _device("box", "cuda", vram_gb=7.5)
    assert profile_cells(p)[0].endswith(" cuda") and not profile_cells(_device("cpu"))[0].endswith("cpu")
    detail = profile_detail("box", "", p, None, "", "").plain
    assert "cuda GFLOP/s: Q4_K 2000" in detail and "VRAM 8.1 GB free" in detail


# --- a node: validation before loading, and what reaches its device layer -------------------------------------------


def _assignment(layout, windows: list[tuple[int, int, int]], n_ctx: int = 256):
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec

    return Assignment(epoch=1, model=ModelIdentity.of(layout, "m.gguf"),
                      windows=tuple(WindowSpec(*w) for w in windows), successor="tcp://127.0.0.1:5999",
                      n_ctx=n_ctx, n_batch=64, n_ubatch=32)


def test_a_node_validates_gpu_layers_against_its_engine(engine_libs, gemma_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.device.memory import reserved_bytes
    from primaplug.engine import read_layout
    from primaplug.node import daemon

    layout = read_layout(gemma_path)
    engine_libs(CPU_LIBS)
    assert daemon._check_assignment(_assignment(layout, [(0, 9, 0)]), layout) == ""
    problem = daemon._check_assignment(_assignment(layout, [(0, 9, 2)]), layout)
    assert problem == ("this node's engine has no GPU backend (built for cpu): rebuild it with `--gpu cuda` "
                       "(scripts/build_engine.py, or `make engine GPU=cuda`; `--gpu metal` on a Mac), or plan "
                       "without GPU layers (-ngl 0)")
    engine_libs(CUDA_LIBS)
    assert daemon._check_assignment(_assignment(layout, [(0, 9, 2)]), layout) == ""
    assert "cannot have 10 GPU layers" in daemon._check_assignment(_assignment(layout, [(0, 9, 10)]), layout)

    # the KV cache of GPU layers lives in VRAM: a device whose RAM holds only the CPU layers' cache takes them
    n_ctx = 1 << 20
    everything = reserved_bytes(layout, [LayerRange(0, 18)], n_ctx, 64, 32)
    cpu_half = reserved_bytes(layout, [LayerRange(9, 18)], n_ctx, 64, 32)
    assert cpu_half < everything
    total = (cpu_half + everything) // 2
    monkeypatch.setattr(daemon, "memory_view", lambda: SimpleNamespace(total_bytes=total))
    assert daemon._check_assignment(_assignment(layout, [(0, 18, 9)], n_ctx), layout) == ""
    assert "ask for a smaller context" in daemon._check_assignment(_assignment(layout, [(0, 18, 0)], n_ctx), layout)


def _cluster(transport, addresses: list[str], gemma_path: Path, **settings: object):
    from primaplug.engine import read_layout
    from primaplug.head.cluster import Cluster, ClusterSettings
    from primaplug.wire import ModelIdentity

    layout = read_layout(gemma_path)
    c = Cluster(transport, ClusterSettings(nodes=tuple(addresses), n_ctx=256, n_batch=64, n_ubatch=32,
                                           load_timeout_s=30, **settings),  # type: ignore[arg-type]
                ModelIdentity.of(layout, gemma_path.name))
    c.connect()
    c.plan()
    return c


def test_a_cpu_node_refuses_gpu_layers_before_loading_and_the_head_says_so(
        engine_libs, gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.node import deployment
    from tests.inproc_nodes import InprocNodes

    engine_libs(CPU_LIBS)
    monkeypatch.setattr(deployment.Deployment, "load", _must_not_load)
    with InprocNodes([gemma_path], 2) as nodes:
        c = _cluster(nodes.head_transport(), nodes.addresses, gemma_path, layers=(9, 9), gpu_layers=(0, 4))
        try:
            with pytest.raises(NodeError, match=r"node node2 .*: this node's engine has no GPU backend \(built for "
                                                r"cpu\): rebuild it with `--gpu cuda`.*or plan without GPU layers "
                                                r"\(-ngl 0\)") as err:
                c.deploy()
            assert err.value.code == "bad_assignment"
            assert nodes.nodes[1].status().state == "idle"  # refused before anything loaded
        finally:
            c.close()


def _must_not_load(*_: object, **__: object) -> None:
    raise AssertionError("the node loaded an assignment it should have refused")


def test_gpu_layers_go_over_the_wire_to_the_node_s_device_layer(engine_libs, gemma_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A split by hand with -ngl per node, two rounds: each node's device layer is asked for the first -ngl layers of
    each of its windows (no more than a window has) on the GPU. The fake stops there: this engine has no GPU."""
    from primaplug.node import deployment
    from tests.inproc_nodes import InprocNodes

    engine_libs(CUDA_LIBS)
    asked: dict[tuple[int, ...], list[int]] = {}

    def load(path, layout, ranges, *, gpu_layers=(), **_: object):
        asked[tuple(r.start for r in ranges)] = list(gpu_layers)
        raise EngineError("fake GPU: the windows stop here")

    monkeypatch.setattr(deployment, "DeviceWindows", SimpleNamespace(load=load))
    with InprocNodes([gemma_path], 2) as nodes:
        # 18 layers, 2 rounds of 9: node1 3, node2 3, the head 3 a round
        c = _cluster(nodes.head_transport(), nodes.addresses, gemma_path, layers=(3, 3, 3), rounds=2,
                     gpu_layers=(2, 5))
        try:
            assert [[(r.start, r.end) for r in rs] for rs in c.node_ranges] == [[(0, 3), (9, 12)], [(3, 6), (12, 15)]]
            with pytest.raises(NodeError, match="fake GPU: the windows stop here") as err:
                c.deploy()
            assert err.value.code == "load_failed"
        finally:
            c.close()
    assert asked[(0, 9)] == [0, 1, 9, 10]
    # node2 may have been told before node1 failed, or not: when it was, it got its windows' layers, clipped
    assert asked.get((3, 12), [3, 4, 5, 12, 13, 14]) == [3, 4, 5, 12, 13, 14]


def test_a_re_formed_ring_keeps_each_node_s_gpu_layers_within_its_windows_and_vram() -> None:
    from primaplug.head.planning import Measured, PlanSettings
    from primaplug.head.recovery import Replanner
    from primaplug.scheduler.halda import gpu_layer_cap
    from primaplug.scheduler.latency import platform

    model = _model(12)
    devices = (_device("head", ram_gb=2), _device("gpu", "cuda", vram_gb=1.7, ram_gb=2), _device("cpu", ram_gb=2),
               _device("big", "cuda", vram_gb=24, ram_gb=2))
    r = Replanner(Measured(model, devices, 4e-3, 5e7), PlanSettings())
    cluster = SimpleNamespace(model=SimpleNamespace(n_layer=12, identity="x"), rounds=1, head_size=2)
    node = {d.name: SimpleNamespace(name=d.name, address=d.name) for d in devices[1:]}
    for left in (["gpu", "cpu", "big"], ["gpu", "cpu"], ["cpu", "big"], ["gpu"]):
        split = r.split(cluster, [node[n] for n in left])
        kept, sizes, gpu_, how = split.nodes, split.sizes, split.gpu, split.how
        assert sum(sizes) == 12 - 2, how  # the head keeps its 2 layers
        p = platform([devices[0], *(d for d in devices if d.name in [k.name for k in kept])], model)
        cap = gpu_layer_cap(p, 1)[1:]
        for k, s, g, room in zip(kept, sizes, gpu_, cap, strict=True):
            assert 0 <= g <= s and g <= room, (left, k.name, s, g, room)
            if k.name == "cpu":
                assert g == 0
        if "big" in [k.name for k in kept]:
            assert gpu_[[k.name for k in kept].index("big")] > 0  # a GPU with room keeps GPU layers
    # by hand: a node's -ngl by address, clipped to its new window; a node that joins gets the count every node was
    # given (none where they differ: tests/test_recovery_logic.py)
    by_hand = Replanner(by_hand={"a": 4, "b": 4, "c": 4}, gpu={"a": 3, "b": 4, "c": 2})
    cluster = SimpleNamespace(model=SimpleNamespace(n_layer=12), rounds=1, head_size=0)
    split = by_hand.split(cluster, [SimpleNamespace(address=x, name=x) for x in ("b", "new")])
    assert split.sizes == [6, 6] and split.gpu == [4, 0]
    by_hand = Replanner(by_hand={"a": 4, "b": 4, "c": 4}, gpu={"a": 8, "b": 8, "c": 8})
    split = by_hand.split(cluster, [SimpleNamespace(address=x, name=x) for x in ("b", "new")])
    assert split.sizes == [6, 6] and split.gpu == [6, 6]


# --- the engine: the placement map and what llama.cpp does with it ----------------------------------------------------


def test_this_engine_refuses_gpu_layers_before_loading(gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.engine import Model, model

    if model.ggml_devices()[1] is not None:
        pytest.skip("this engine has a GPU: tests/test_gpu_layers.py runs GPU layers on it")
    written: list[object] = []
    monkeypatch.setattr(model, "repacked_copy", lambda *a, **k: written.append(a))
    with pytest.raises(EngineError, match=r"GPU layers 0-1, 9 asked for: this engine has no GPU backend \(built for "
                                          r"cpu; llama.cpp's backends here: CPU\): rebuild it with `--gpu cuda`.*"
                                          r"\(-ngl 0\)"):
        Model(gemma_path, [(0, 18)], gpu_layers=[0, 1, 9])
    assert written == []  # refused before the repacked copy is written or anything is mapped
    with Model(gemma_path, [(0, 18)], gpu_layers=[]) as m:  # no GPU layers: as ever
        assert m.layers == frozenset(range(18))


def test_a_gpu_that_cannot_run_is_left_out_of_the_profile(model_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build whose GPU llama.cpp cannot find (here: this CPU engine under a "cuda" fingerprint) gets no GPU
    rate: its GPU timing is refused, where llama.cpp would have timed the CPU and called it the GPU's."""
    from primaplug.engine import model
    from primaplug.profiler import compute

    if model.ggml_devices()[1] is not None:
        pytest.skip("this engine has a GPU")
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))
    calib = model_dir / "gpu-fakes-profile"
    measured = cache.Measured(fingerprint=_fp(backend="cuda"), cpu_flops={})
    device._measure_compute(measured, ["F32"], calib)
    assert set(measured.cpu_flops) == {"F16", "F32"} and all(f > 0 for f in measured.cpu_flops.values())
    assert measured.gpu_flops == {}
    paths = list(compute.calibration_models(calib / "calibration", ["F32"]).values())
    with pytest.raises(EngineError, match="GPU layers 0 asked for: this engine has no GPU backend"):
        compute.time_layers(paths[:1], 4, 1, gpu=True)


def test_the_gpu_backend_problems_say_what_to_do(monkeypatch: pytest.MonkeyPatch, gemma_path: Path) -> None:
    from primaplug.engine import model

    for devices, expected in (
        ((("CUDA", "CPU"), "CUDA0 (NVIDIA H100 80GB HBM3)"), ""),
        ((("CUDA", "CPU"), None), "this engine has the CUDA backend, but llama.cpp finds no GPU device (no driver, "
                                  "or CUDA_VISIBLE_DEVICES hides them): check nvidia-smi, or run without GPU layers "
                                  "(-ngl 0)"),
        ((("CPU", "BLAS"), None), "this engine has no GPU backend (built for cpu; llama.cpp's backends here: CPU, "
                                  "BLAS): rebuild it with `--gpu cuda` (scripts/build_engine.py, or `make engine "
                                  "GPU=cuda`; `--gpu metal` on a Mac), or run without GPU layers (-ngl 0)"),
    ):
        monkeypatch.setattr(model, "ggml_devices", lambda devices=devices: devices)
        assert model.gpu_problem() == expected


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[bytes]:
    """llama.cpp "finds a GPU", and every placement map handed to llama_model_load_for_windows is recorded. On this
    engine the load goes on, and llama.cpp itself puts the GPU-placed layers on the CPU (patches/0002).

    The repacked copy goes to a cache of the test's own: the shared one (~/.cache/primaplug/repacked) is mapped by
    other test runs of the machine, and a test must not depend on what they wrote there."""
    from primaplug.engine import _native, model

    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model, "gpu_problem", lambda: "")
    maps: list[bytes] = []
    real = _native.load_for_windows

    def spy(path: str, placement: ctypes.Array[ctypes.c_uint8], **kwargs: object) -> int:
        maps.append(bytes(placement))
        return real(path, placement, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_native, "load_for_windows", spy)
    return maps


def test_the_placement_map_puts_gpu_layers_on_the_gpu(gemma_path: Path, fake_gpu: list[bytes],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.engine import Model, _native, model, repacked

    skip, on_cpu, on_gpu, repacked_cpu = (_native.LLAMA_WINDOW_PLACEMENT_SKIP, _native.LLAMA_WINDOW_PLACEMENT_CPU,
                                          _native.LLAMA_WINDOW_PLACEMENT_GPU,
                                          _native.LLAMA_WINDOW_PLACEMENT_CPU_REPACKED)
    copies: list[tuple[frozenset[int], frozenset[int]]] = []
    real_copy = model.repacked_copy

    def copy(layout, cpu_layers, gpu_layers, **kw):
        copies.append((frozenset(cpu_layers), frozenset(gpu_layers)))
        return real_copy(layout, cpu_layers, gpu_layers, **kw)

    monkeypatch.setattr(model, "repacked_copy", copy)
    with Model(gemma_path, [(0, 4), (12, 18)], output=False, gpu_layers=[0, 1, 12]) as m:
        placement = fake_gpu[-1]
        cpu = repacked_cpu if m.copy else on_cpu
        assert len(placement) == 18 + 1
        assert [placement[il] for il in (0, 1, 12)] == [on_gpu] * 3
        assert [placement[il] for il in (2, 3, *range(13, 18))] == [cpu] * 7
        assert [placement[il] for il in range(4, 12)] == [skip] * 8 and placement[18] == skip  # no output layer
        if m.copy:  # the repacked copy holds the CPU layers repacked and the GPU layers as the file has them
            assert copies[-1] == (frozenset({2, 3, 13, 14, 15, 16, 17}), frozenset({0, 1, 12}))
    units = repacked.units_for(m.layout, [2, 3], [0, 1], output=False)
    assert "blk.0.raw" in units and "blk.1.raw" in units and "blk.2" in units and "blk.0" not in units
    with Model(gemma_path, [(0, 18)], output=True, gpu_layers=range(18), repack=False):
        assert fake_gpu[-1] == bytes([on_gpu] * 18 + [on_cpu])  # every layer on the GPU, the output one on the CPU


def test_gpu_layers_never_rewrite_the_copy_that_cpu_layers_are_mapped_from(gemma_path: Path,
                                                                             fake_gpu: list[bytes]) -> None:
    """A process running layers on its CPU maps them from the device's repacked copy; another process of the machine
    loading some of them on a GPU (local nodes after a re-forming) needs them raw. It gets a copy of its own: the
    bytes under the first one's mapping stay as they were (here both Models are in one process)."""
    from primaplug.engine import Model, read_layout

    layout = read_layout(gemma_path)

    def read(path: str, layers: range) -> dict[str, bytes]:
        with open(path, "rb") as f:
            return {t.name: os.pread(f.fileno(), t.nbytes, t.offset) for il in layers for t in layout.layer_tensors(il)}

    with Model(gemma_path, [(0, 18)], output=False) as on_cpu:
        copy = on_cpu.copy
        if copy is None or not any(t.name in copy.repacked for t in layout.layer_tensors(0)):
            pytest.skip("this CPU repacks none of layer 0's weights: they have one form")
        before = read(copy.path, range(18))
        with Model(gemma_path, [(0, 18)], output=False, gpu_layers=range(6)) as on_gpu:
            assert read(copy.path, range(18)) == before, "the layers now on a GPU were rewritten under on_cpu"
            assert on_gpu.copy is not None and on_gpu.copy.path != copy.path
            assert read(on_gpu.copy.path, range(6)) == read(os.fspath(gemma_path), range(6))  # raw, for the GPU
            assert read(on_gpu.copy.path, range(6, 18)) == {k: v for k, v in before.items()
                                                            if layout.tensor(k).layer >= 6}  # type: ignore[union-attr]
        manifest = json.loads(Path(copy.path).with_suffix(".json").read_text())
        assert {f"blk.{il}" for il in range(18)} <= set(manifest["units"])
        assert not any(u.endswith(".raw") for u in manifest["units"])
        gpu_copy = on_gpu.copy.path
    with Model(gemma_path, [(3, 18)], output=False, gpu_layers=range(3, 6)) as other:  # other GPU layers: another
        assert other.copy is not None and other.copy.path not in (copy.path, gpu_copy)
    with Model(gemma_path, [(0, 18)], output=False, gpu_layers=range(6)) as again:  # the same: its copy, as written
        assert again.copy is not None and again.copy.path == gpu_copy and again.copy.built_bytes == 0


def test_llama_cpp_runs_gpu_placed_layers_on_the_cpu_when_it_has_no_gpu(gemma_path: Path,
                                                                        fake_gpu: list[bytes]) -> None:
    """What the refusal guards against: without a GPU device llama.cpp loads a GPU-placed layer into the CPU's
    buffers without a word (copied and repacked into anonymous memory, which the plan counted as VRAM), and computes
    the same logits as plain llama-cpp-python."""
    from primaplug.engine import ContextSettings, Model, model
    from primaplug.engine.reference import plain_llama_forward

    if model.ggml_devices()[1] is not None:
        pytest.skip("this engine has a GPU")
    settings = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32)
    with Model(gemma_path, [(0, 18)], gpu_layers=range(6)) as m:
        assert fake_gpu[-1][:6] == bytes([2] * 6)
        assert m.copied_bytes > 0  # the "GPU" layers, copied out of the mapping
        prompt = m.tokenize("The quick brown fox jumps over the lazy dog because it wanted to")
        got = np.asarray(m.window(0, 18, settings=settings).forward(np.array(prompt, dtype=np.int32), 0)).ravel()
    with plain_llama_forward(gemma_path, settings) as forward:
        expected = forward(prompt, 0)
    assert np.array_equal(got, expected)


# --- the head: -ngl without nodes, and a plan's GPU layers for the head -----------------------------------------------


def test_ngl_without_nodes_puts_the_head_s_windows_on_its_gpu(gemma_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import primaplug
    from primaplug.head import llama

    asked: list[tuple[list[tuple[int, int]], list[int]]] = []

    class StopError(Exception):
        pass

    def load(path, layout, ranges, *, gpu_layers=(), **_: object):
        asked.append(([(r.start, r.end) for r in ranges], list(gpu_layers)))
        raise StopError

    monkeypatch.setattr(llama, "DeviceWindows", SimpleNamespace(load=load))
    with pytest.raises(StopError):
        primaplug.Llama(gemma_path, layers=[6, 6, 6], node_gpu_layers=2, verbose=False)
    with pytest.raises(StopError):
        primaplug.Llama(gemma_path, layers=[6, 6, 6], verbose=False)
    assert asked == [([(0, 6), (6, 12), (12, 18)], [0, 1, 6, 7, 12, 13]), ([(0, 6), (6, 12), (12, 18)], [])]
    with pytest.raises(ConfigError, match=r"without nodes, node_gpu_layers \(-ngl\) is one count \(0 or more\)"):
        primaplug.Llama(gemma_path, node_gpu_layers=[2])
    with pytest.raises(ConfigError, match="got -1"):
        primaplug.Llama(gemma_path, node_gpu_layers=-1)


def test_ngl_without_nodes_on_this_cpu_engine_is_refused(gemma_path: Path) -> None:
    import primaplug
    from primaplug.engine import model

    if model.ggml_devices()[1] is not None:
        pytest.skip("this engine has a GPU: tests/test_gpu_layers.py runs -ngl on it")
    with pytest.raises(EngineError, match=r"GPU layers 0-3, 9-12 asked for: this engine has no GPU backend \(built "
                                          r"for cpu.*\(-ngl 0\)"):
        primaplug.Llama(gemma_path, layers=[9, 9], node_gpu_layers=4, verbose=False)


def test_a_plan_s_gpu_layers_for_the_head_reach_its_windows() -> None:
    """Halda gives a head with a GPU GPU layers of its own; the head's windows take them (they were dropped)."""
    from primaplug.head.cluster import Cluster, ClusterSettings
    from primaplug.scheduler import solve
    from primaplug.transport import InprocNetwork, InprocTransport

    model = _model(12)
    plan = solve([_device("head", "cuda", vram_gb=2.5)], model, latency_model="ring", rounds=2)
    n = plan.head.n
    assert 0 < n < 6 and plan.head.windows == (LayerRange(0, 6), LayerRange(6, 12))
    c = Cluster(InprocTransport(InprocNetwork()), ClusterSettings(nodes=()),
                SimpleNamespace(n_layer=12, identity="x"))  # type: ignore[arg-type]
    c.apply_plan(plan, [])
    assert c.head_gpu_layers() == [*range(n), *range(6, 6 + n)]
    cpu_plan = solve([_device("head")], model, latency_model="ring", rounds=2)
    c.apply_plan(cpu_plan, [])
    assert c.head_gpu_layers() == []
    c.close()


# --- the device layer: memory for GPU layers --------------------------------------------------------------------------


def test_gpu_layers_take_no_ram_in_the_device_s_memory_plan(gemma_path: Path, fake_gpu: list[bytes]) -> None:
    """llama.cpp holds a GPU layer's weights and KV cache in VRAM: the plan keeps, prefetches and releases only the
    CPU layers' bytes, and its budget is not spent on the GPU layers."""
    from primaplug.device import DeviceWindows, MemorySettings
    from primaplug.engine import ContextSettings, read_layout
    from primaplug.engine.layout import merge_ranges

    layout = read_layout(gemma_path)
    gpu_spans = layout.window_ranges(LayerRange(0, 9))
    cpu_spans = layout.window_ranges(LayerRange(9, 18))
    cpu_bytes = sum(n for _, n in cpu_spans)
    assert sum(n for _, n in gpu_spans) > 8 << 20  # the whole window does not fit in the larger budget below
    context = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32)
    for budget, mode in ((8 << 20, "stream"), (cpu_bytes + (8 << 20), "resident")):
        d = DeviceWindows.load(gemma_path, layout, [LayerRange(0, 18)], context=context,
                               memory=MemorySettings(budget_bytes=budget), gpu_layers=list(range(9)))
        try:
            assert fake_gpu[-1][:9] == bytes([2] * 9)
            plan = d.plan.prefetch
            assert plan.mode == mode  # the CPU half fits in a budget the whole window does not
            planned = merge_ranges([*plan.keep, *(r for window in plan.stream for r in window)])
            overlap = [(o, n) for o, n in planned for g, m in gpu_spans if o < g + m and g < o + n]
            assert overlap == [], "the memory plan prefetches and counts the GPU layers' weights"
            assert planned == cpu_spans  # and every CPU layer's bytes are in it
            assert d.hooks.first == {0: 0}
        finally:
            d.close()


def test_the_prefetch_units_of_windows_with_gpu_layers() -> None:
    """Each window's CPU part is what the prefetcher holds: a window all on the GPU has no unit, and layer by layer
    a GPU layer's start moves no unit."""
    from primaplug.core.errors import WindowRangeError
    from primaplug.device.memory import cpu_parts
    from primaplug.device.windows import PrefetchHooks

    windows = [LayerRange(0, 4), LayerRange(4, 4), LayerRange(6, 8), LayerRange(10, 13)]
    assert cpu_parts(windows, ()) == windows  # no GPU layers: the windows as they are
    parts = cpu_parts(windows, [0, 1, 6, 7])
    assert parts == [LayerRange(2, 4), LayerRange(4, 4), LayerRange(8, 8), LayerRange(10, 13)]
    with pytest.raises(WindowRangeError, match=r"GPU layers \[11\] of window \[10, 13\) are not its first 1"):
        cpu_parts(windows, [11])

    events: list[tuple[str, int, bool]] = []

    class Recorder:
        def window_started(self, unit: int) -> None:
            events.append(("started", unit, False))

        def window_done(self, unit: int, *, last_of_token: bool) -> None:
            events.append(("done", unit, last_of_token))

    whole = PrefetchHooks(parts, per_layer=False)
    whole.prefetcher = Recorder()  # type: ignore[assignment]
    assert whole.first == {0: 0, 3: 1}
    for r in range(4):
        whole.started(r)
        whole.done(r)
    assert events == [("started", 0, False), ("done", 0, False), ("started", 1, False), ("done", 1, True)]

    events.clear()
    layers = PrefetchHooks(parts, per_layer=True)
    layers.prefetcher = Recorder()  # type: ignore[assignment]
    assert layers.first == {0: 0, 3: 2}
    assert layers.on_layer(1) is None and layers.on_layer(2) is None  # a relay round; a window all on the GPU
    for r, window in enumerate(windows):
        hook = layers.on_layer(r)
        for il in range(window.start, window.end):
            if hook is not None:
                hook(il)
        layers.done(r)
    assert events == [("started", 0, False), ("done", 0, False), ("started", 1, False), ("done", 1, False),
                      ("started", 2, False), ("done", 2, False), ("started", 3, False), ("done", 3, False),
                      ("started", 4, False), ("done", 4, True)]


def test_profiles_carry_the_gpu_over_the_wire() -> None:
    from primaplug.wire import ProfileReply, decode_reply, encode

    p = _device("box", "cuda", vram_gb=7.5)
    back = decode_reply(encode(ProfileReply(node="box", profile=p)))
    assert isinstance(back, ProfileReply) and back.profile == p
    assert msgspec.structs.replace(back.profile, name="x").has_gpu
