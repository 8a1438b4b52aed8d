"""Halda's latency model (appendix A.3) against values worked out by hand, one case per device set."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.scheduler import predict_latency
from primaplug.scheduler.latency import M1, M2, M3, M4, assign_sets, platform, predict, set_coefficients

# b = 100 MB per layer; KV: 1000 bytes per token and layer for n_kv = 1000 tokens, so b' = 101 MB
# one input row: b_i / V = 1e8 / 1000 = 100 kB; head extras b_i/V + b_o = 50.1 MB; c^cpu = 10 MB, c^gpu = 20 MB
# per window (each window is a llama.cpp context with its own compute buffers; a CPU one is given back after a
# prompt, so every window after a device's first pays only the 1e6 a one-token decode touches)
MODEL = ModelProfile(
    name="tiny", n_layer=4, n_vocab=1000, n_embd=256, layer_bytes=100_000_000, input_bytes=100_000_000,
    output_bytes=50_000_000, layer_flops={"Q4_K": 2e9, "F32": 1e8}, output_flops={"Q6_K": 1e9},
    kv_bytes_per_token_layer=1000, n_kv=1000, compute_buffer_cpu_bytes=10_000_000,
    compute_buffer_gpu_bytes=20_000_000, compute_buffer_row_bytes=1_000_000,
)
# per CPU layer: compute 2e9/1e11 + 1e8/5e10 = 0.022 s; KV copy 1000/1e9 = 1e-6 s; reads 101e6/1e10 = 0.0101 s
# head: output layer 1e9/1e11 = 0.01 s; reading 50.1 MB at 1e10 = 0.00501 s
# per GPU layer: compute 2e9/1e12 + (F32 has no GPU rate: CPU's) 0.002 = 0.004 s; KV 1e-7 s; reads 0.00101 s
# per window: host<->device copies 2 * (1e-5 + 1024/1e9) = 2.2048e-5 s; message 1e-3 + 1024/1.024e7 = 1.1e-3 s
CPU = dict(cpu_flops={"Q4_K": 1e11, "F32": 5e10, "Q6_K": 1e11}, cpu_read_bps=1e10, kv_copy_cpu_bps=1e9,
           link_latency_s=1e-3, link_bps=1.024e7, disk_seq_bps=1e9, disk_rand_bps=5e8)
GPU = dict(gpu_flops={"Q4_K": 1e12}, gpu_read_bps=1e11, kv_copy_gpu_bps=1e10)
CUDA_COPY = dict(h2d_bps=1e9, d2h_bps=1e9, copy_latency_s=1e-5)
CPU_LAYER, CPU_MEM, GPU_LAYER, GPU_MEM = 0.022, 0.010101, 0.004, 0.0010101
COPY, MESSAGE = 2.2048e-5, 1.1e-3


def dev(name: str, os: str = "linux", **kw: object) -> DeviceProfile:
    return DeviceProfile(name=name, os=os, **{**CPU, **kw})


def head(**kw: object) -> DeviceProfile:
    return dev("head", mem_available_bytes=1_000_000_000, **kw)


def check(pred, i: int, compute: float, memory: float, disk: float, network: float) -> None:
    got = (pred.compute_s[i], pred.memory_s[i], pred.disk_s[i], pred.network_s[i])
    assert got == pytest.approx((compute, memory, disk, network), rel=1e-9, abs=1e-15)


def test_head_that_fits_m4_two_rounds() -> None:
    devices = [head(), dev("peer", mem_available_bytes=1_000_000_000)]
    pred = predict_latency(devices, MODEL, 2, [1, 1], [0, 0])  # 2 rounds x 2 windows of 1 layer
    # head: 2 layers; compute 2 * 0.022 + output 0.01; memory 2 * 0.010101 + 0.00501;
    # RAM 2 layers * 101e6 + 50.1e6 + a 10e6 compute buffer + 1e6 for the second window = 263.1e6 <= 1e9: M4,
    # disk = one input row 1e5 / 1e9; 2 messages
    check(pred, 0, 2 * CPU_LAYER + 0.01, 2 * CPU_MEM + 0.00501, 1e-4, 2 * MESSAGE)
    # peer: no head terms, no disk
    check(pred, 1, 2 * CPU_LAYER, 2 * CPU_MEM, 0.0, 2 * MESSAGE)
    assert pred.ram_bytes.tolist() == [263_100_000, 213_000_000]
    assert pred.vram_bytes.tolist() == [0, 0]
    assert pred.total_s == pytest.approx(4 * CPU_LAYER + 0.01 + 4 * CPU_MEM + 0.00501 + 1e-4 + 4 * MESSAGE)
    p = platform(devices, MODEL)
    assert assign_sets(p, 2, np.array([1, 1]), np.array([0, 0])).tolist() == [M4, M4]


def test_the_head_pays_the_output_contexts_buffer_once() -> None:
    m = msgspec.structs.replace(MODEL, compute_buffer_output_bytes=5_000_000)
    pred = predict_latency([head(), dev("peer", mem_available_bytes=10**9)], m, 2, [1, 1], [0, 0])
    # as above plus 5e6 on the head only, whatever the number of windows
    assert pred.ram_bytes.tolist() == [268_100_000, 213_000_000]


def test_android_m3_uses_swap() -> None:
    phone = dev("phone", os="android", mem_available_bytes=200_000_000, swap_can_bytes=50_000_000,
                swap_free_bytes=30_000_000, disk_seq_bps=5e8)
    pred = predict_latency([head(), phone], MODEL, 1, [1, 3], [0, 0])
    # d^swapout = min(50e6, 30e6) = 30e6, so the phone has 230e6; it needs 3 * 101e6 + 10e6 = 313e6:
    # 83e6 re-read per token at its sequential 5e8 B/s = 0.166 s
    check(pred, 1, 3 * CPU_LAYER, 3 * CPU_MEM, 0.166, MESSAGE)
    assert pred.disk_bytes[1] == 83_000_000 and pred.ram_bytes[1] == 230_000_000
    assert assign_sets(platform([head(), phone], MODEL), 1, np.array([1, 3]), np.array([0, 0]))[1] == M3


def test_linux_cuda_m3_gpu_layers_leave_ram() -> None:
    box = dev("box", backend="cuda", mem_available_bytes=150_000_000, vram_free_bytes=1_000_000_000,
              **GPU, **CUDA_COPY)
    pred = predict_latency([head(), box], MODEL, 1, [1, 3], [0, 1])
    # 2 CPU layers + 1 GPU layer; RAM 2 * 101e6 + 10e6 = 212e6 > 150e6: 62e6 at 1e9 B/s = 0.062 s
    # one window: both host<->device copies and one message
    check(pred, 1, 2 * CPU_LAYER + GPU_LAYER, 2 * CPU_MEM + GPU_MEM + COPY, 0.062, MESSAGE)
    assert pred.vram_bytes[1] == 101_000_000 + 20_000_000


def test_macos_without_metal_m1_reads_at_random_speed() -> None:
    mac = dev("mac", os="macos", mem_available_bytes=250_000_000)
    pred = predict_latency([head(), mac], MODEL, 1, [1, 3], [0, 0])
    # 3 * 101e6 + 10e6 = 313e6 > 250e6: 63e6 at the random-read 5e8 B/s = 0.126 s
    check(pred, 1, 3 * CPU_LAYER, 3 * CPU_MEM, 0.126, MESSAGE)
    assert assign_sets(platform([head(), mac], MODEL), 1, np.array([1, 3]), np.array([0, 0]))[1] == M1


@pytest.mark.parametrize(("working_set", "disk"), [(300_000_000, 0.6), (400_000_000, 0.0)])
def test_macos_metal_m2_rereads_its_whole_share(working_set: int, disk: float) -> None:
    mac = dev("mac", os="macos", backend="metal", unified_memory=True, metal_working_set_bytes=working_set, **GPU,
              **CUDA_COPY)
    pred = predict_latency([head(), mac], MODEL, 1, [1, 3], [0, 3])
    # 3 * 101e6 + c^cpu 10e6 + c^gpu 20e6 = 333e6; over a 300e6 working set Metal re-reads all 3 layers' weights
    # (3 * 100e6 at 5e8 B/s = 0.6 s), within 400e6 nothing; unified memory: no host<->device copies
    check(pred, 1, 3 * GPU_LAYER, 3 * GPU_MEM, disk, MESSAGE)
    sets = assign_sets(platform([head(), mac], MODEL), 1, np.array([1, 3]), np.array([0, 3]))
    assert sets[1] == (M2 if disk else M4)
    assert pred.ram_bytes[1] + pred.vram_bytes[1] == min(333_000_000, working_set)


def test_slow_disk_is_m4_even_when_it_overflows() -> None:
    board = dev("board", mem_available_bytes=150_000_000, disk_seq_bps=1e8)
    p = platform([head(), board], MODEL)
    pred = predict(p, 1, np.array([1, 3]), np.array([0, 0]))
    # the model still prices the overflow (313e6 - 150e6 = 163e6 at 1e8 B/s), but the set is M4: Halda never
    # lets it spill
    assert pred.disk_s[1] == pytest.approx(1.63)
    assert assign_sets(p, 1, np.array([1, 3]), np.array([0, 0]))[1] == M4


def test_head_overflow_includes_its_extras() -> None:
    small = dev("head", mem_available_bytes=300_000_000)
    pred = predict_latency([small, dev("peer", mem_available_bytes=10**9)], MODEL, 1, [3, 1], [0, 0])
    # 3 * 101e6 + 50.1e6 + 10e6 = 363.1e6 > 300e6: 63.1e6 at 1e9 B/s
    assert pred.disk_s[0] == pytest.approx(0.0631)


def test_unmeasured_links_and_copies_cost_nothing() -> None:
    box = DeviceProfile(name="box", os="linux", backend="cuda", cpu_flops={"Q4_K": 1e11, "F32": 5e10, "Q6_K": 1e11},
                        gpu_flops={"Q4_K": 1e12}, mem_available_bytes=10**9, vram_free_bytes=10**9, disk_seq_bps=1e9)
    pred = predict_latency([box], MODEL, 1, [4], [2])
    assert pred.network_s[0] == 0.0 and pred.memory_s[0] == 0.0


def test_coefficients_reproduce_the_model_for_consistent_sets() -> None:
    # five devices, one per rule; L = 13 = 1 + 3 + 3 + 3 + 3 with k = 1, or 26 with k = 2
    devices = [
        head(),
        dev("phone", os="android", mem_available_bytes=200_000_000, swap_can_bytes=50_000_000,
            swap_free_bytes=30_000_000, disk_seq_bps=5e8),
        dev("box", backend="cuda", mem_available_bytes=150_000_000, vram_free_bytes=10**9, **GPU, **CUDA_COPY),
        dev("mac", os="macos", mem_available_bytes=250_000_000),
        dev("metal", os="macos", backend="metal", unified_memory=True, metal_working_set_bytes=300_000_000, **GPU),
    ]
    w, n = np.array([1, 3, 3, 3, 3]), np.array([0, 0, 1, 0, 3])
    for k in (1, 2):
        p = platform(devices, msgspec.structs.replace(MODEL, n_layer=13 * k))
        sets = assign_sets(p, k, w, n)
        assert sets.tolist() == [M4, M3, M3, M1, M2]
        a, b, c, kappa = set_coefficients(p, sets, k)
        assert k * (a @ w + b @ n + c.sum()) + kappa == pytest.approx(float(predict(p, k, w, n).total_s), rel=1e-12)


def test_a_mixture_of_experts_is_priced_by_what_a_token_reads() -> None:
    """Of a layer that is 90% routed experts, a token uses an eighth of those: its CPU reads the rest and that
    eighth into registers, and a device that spills re-reads that share of what does not fit, each token (a node
    reads only the chosen experts, memory/experts.py); memory still holds every expert. The set coefficients that
    Halda's ILP takes reproduce the model for it too."""
    moe = msgspec.structs.replace(MODEL, layer_expert_bytes=90_000_000, expert_token_share=1 / 8)
    box = dev("box", mem_available_bytes=150_000_000)
    dense, experts = platform([head(), box], MODEL), platform([head(), box], moe)
    share = 1 - 90e6 * (7 / 8) / 101e6  # of b' = 101 MB, a token reads 101 - 78.75 MB
    assert experts.stream_share == pytest.approx(share) and dense.stream_share == 1.0
    assert experts.m_cpu[1] == pytest.approx(1e-6 + share * 101e6 / 1e10)
    w, n = np.array([1, 3]), np.array([0, 0])
    a, b = predict(dense, 1, w, n), predict(experts, 1, w, n)
    assert a.overflows[1] and b.overflows[1]
    assert b.disk_bytes[1] == pytest.approx(share * a.disk_bytes[1]) and b.ram_bytes[1] == a.ram_bytes[1]
    sets = assign_sets(experts, 1, w, n)
    coefficients = set_coefficients(experts, sets, 1)
    assert (coefficients[0] @ w + coefficients[1] @ n + coefficients[2].sum() + coefficients[3]
            == pytest.approx(float(b.total_s), rel=1e-12))


def test_round_count_must_cover_the_model() -> None:
    with pytest.raises(ValueError, match="cover 6 layers, not 4"):
        predict_latency([head()], MODEL, 2, [3], [0])
