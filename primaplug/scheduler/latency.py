"""Halda's latency model (prima.cpp, appendix A.3): predicted time per token and memory use, per device.

Devices are given in the order the caller lists them, `devices[0]` being the head (the paper's m = 1). The model
is the paper's Eq. 11: the time per token is the *sum* over devices of compute, memory access, disk and network
time (no overlap is assumed). Everything here is vectorised: `w` and `n` may carry leading axes (many candidate
placements at once), the last axis being the device. docs/halda.md explains each decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from primaplug.core.profiles import DeviceProfile, ExpertBytes, ModelProfile

DeviceSet = Literal["M1", "M2", "M3", "M4"]
SET_NAMES: tuple[DeviceSet, ...] = ("M1", "M2", "M3", "M4")
M1, M2, M3, M4 = 0, 1, 2, 3  # indices into SET_NAMES
FREE = -1  # not a paper set: a fast-disk device whose RAM is not constrained (Halda's repair step)

# below this disk read speed a device never spills layers to disk (s^disk_threshold; not given by the paper)
DEFAULT_SLOW_DISK_BPS = 400e6

# which of the paper's OS-specific disk and memory rules (Eqs. 15-17) applies to a device
LINUX, ANDROID, MACOS_CPU, MACOS_METAL = 0, 1, 2, 3


def _per(nbytes: float, bps: float, latency: float = 0.0) -> float:
    """Seconds to move `nbytes` at `bps` after `latency`; the latency alone when the throughput was not measured
    (bps == 0)."""
    return latency + (nbytes / bps if bps > 0 else 0.0)


def _flops_time(work: dict[str, float], rates: dict[str, float], device: str, backend: str) -> float:
    """Sum over quantization types of FLOPs / FLOP/s (Eq. 12's sums)."""
    known = [r for r in rates.values() if r > 0]
    total = 0.0
    for q, flops in work.items():
        if flops <= 0:
            continue
        rate = rates.get(q, 0.0)
        if rate <= 0:
            if not known:
                raise ValueError(f"device {device!r} has no {backend} FLOP/s measured; profile it before planning")
            rate = min(known)  # a type the profiler skipped: assume the device's slowest measured type
        total += flops / rate
    return total


@dataclass(frozen=True, eq=False)
class Platform:
    """The set-independent constants of the latency model for one device list (index 0 = head) and one model.

    Times are seconds, sizes bytes. `*_cap` and `*_fixed` are integers so that "fits" and "overflows" are exact.
    """

    names: tuple[str, ...]
    n_layer: int
    kind: np.ndarray  # LINUX, ANDROID, MACOS_CPU or MACOS_METAL
    gpu: np.ndarray  # bool: may hold GPU layers (CUDA off macOS, Metal on macOS)
    head: np.ndarray  # bool: True for devices[0] only
    t_cpu: np.ndarray  # compute of one layer on the CPU: sum_q f^q / s^{cpu,q}
    t_gpu: np.ndarray  # ... on the GPU (types with no GPU rate run at the CPU rate)
    m_cpu: np.ndarray  # memory access of one CPU layer: KV copy + reading b' into registers
    m_gpu: np.ndarray  # ... of one GPU layer
    t_out: float  # head: the output layer's compute on its CPU
    m_head: float  # head: reading one input row and the output layer
    copy: np.ndarray  # per window: RAM->VRAM + VRAM->RAM copy of a hidden state (0 without a GPU or with UMA)
    comm: np.ndarray  # per window: one hidden state to the next device (t^comm)
    disk_bps: np.ndarray  # s^disk: random reads on macOS, sequential on Linux and Android
    slow_disk: np.ndarray  # bool: s^disk <= threshold, never allowed to spill (always in M4)
    ram_cap: np.ndarray  # int: d^avail (+ d^swapout on Android); d^avail_metal with Metal
    ram_total: np.ndarray  # int: total memory (the cgroup's limit inside one); 0 where not measured
    ram_head: np.ndarray  # int: head only: b_i/V + b_o + the output context's compute buffer
    ram_window: np.ndarray  # int: a device's first window (one llama.cpp context each): c^cpu (+ c^gpu on Metal)
    ram_window_more: np.ndarray  # int: each further window: a one-token c^cpu (ModelProfile; + c^gpu on Metal)
    vram_cap: np.ndarray  # int: d^avail_cuda, or d^avail_metal; 0 without a usable GPU
    vram_head: np.ndarray  # int: b_o on a Metal head (Eq. 35)
    vram_window: np.ndarray  # int: c^gpu per window on a device with a usable GPU
    layer_bytes: int  # b
    layer_kv_bytes: int  # b' = b + KV of one layer for n_kv tokens
    head_extra: int  # b_i/V + b_o: bytes only the head holds
    lookup_bytes: int  # b_i/V: one row of the input embedding
    expert_bytes: int = 0  # of layer_bytes, a mixture of experts' routed experts (ModelProfile.layer_expert_bytes)
    expert_share: float = 0.0  # the share of them one token uses
    tail_layers: int = 0  # the head's last window holds at least these last layers (ModelProfile.tail_layers)
    barred_starts: tuple[int, ...] = ()  # layers no window may start at (ModelProfile.barred_starts)

    def boundaries_allowed(self, k: int) -> np.ndarray | None:
        """For each t of 0..n_layer/k: whether a window may end t layers into every round of k (no barred start
        at any of them); None when any may (no barred start), or when a round itself may not start where it must."""
        if not self.barred_starts:
            return None
        per_round, barred = self.n_layer // k, set(self.barred_starts)
        return np.array([all(r * per_round + t not in barred for r in range(k)) for t in range(per_round + 1)])

    @property
    def n_devices(self) -> int:
        return len(self.names)

    def ram_fixed(self, k: int) -> np.ndarray:
        """Bytes besides layers counted against ram_cap with k windows per device (the paper's B_m)."""
        return self.ram_head + self.ram_window + (k - 1) * self.ram_window_more

    def vram_room(self, k: int) -> np.ndarray:
        """VRAM left for GPU layers with k windows per device; negative: the GPU cannot be used."""
        return np.where(self.gpu, self.vram_cap - k * self.vram_window - self.vram_head, -1)

    @property
    def experts(self) -> ExpertBytes | None:
        """A mixture of experts' layer three ways, or None for a dense model (ModelProfile.experts)."""
        if not self.expert_bytes or not self.expert_share:
            return None
        return ExpertBytes(self.layer_bytes, self.expert_bytes, self.expert_share)

    @property
    def stream_share(self) -> float:
        """The share of a layer's bytes (with its KV cache) that a token reads: 1 for a dense layer; for a mixture
        of experts, the rest of the layer and the share of its routed experts the token chooses. Bytes that do not
        fit are re-read at this share each token (a node reads only the chosen experts: memory/experts.py), and a
        CPU layer's weights are read into registers at it."""
        experts = self.experts
        if experts is None or not self.layer_kv_bytes:
            return 1.0
        return 1.0 - experts.unused_bytes / self.layer_kv_bytes

    @property
    def alpha(self) -> np.ndarray:
        """alpha_m: seconds per layer on the CPU (compute, KV copy, register loads)."""
        return self.t_cpu + self.m_cpu

    @property
    def beta(self) -> np.ndarray:
        """beta_m: seconds saved (negative) or added per layer moved from the CPU to the GPU."""
        return np.where(self.gpu, self.t_gpu + self.m_gpu - self.alpha, 0.0)

    @property
    def xi(self) -> np.ndarray:
        """xi_m: seconds per window (host<->device copies and one message to the next device)."""
        return self.copy + self.comm

    def subset(self, keep: Sequence[int]) -> Platform:
        """The same constants for devices `keep` (keep[0] must be 0: the head stays first)."""
        if not keep or keep[0] != 0:
            raise ValueError("a subset of devices must keep the head (index 0) first")
        idx = np.asarray(keep)
        arrays = {f: getattr(self, f)[idx] for f in _PER_DEVICE}
        return Platform(
            names=tuple(self.names[i] for i in keep), n_layer=self.n_layer, t_out=self.t_out, m_head=self.m_head,
            layer_bytes=self.layer_bytes, layer_kv_bytes=self.layer_kv_bytes, head_extra=self.head_extra,
            lookup_bytes=self.lookup_bytes, expert_bytes=self.expert_bytes, expert_share=self.expert_share,
            tail_layers=self.tail_layers, barred_starts=self.barred_starts, **arrays,
        )


_PER_DEVICE = ("kind", "gpu", "head", "t_cpu", "t_gpu", "m_cpu", "m_gpu", "copy", "comm", "disk_bps", "slow_disk",
               "ram_cap", "ram_total", "ram_head", "ram_window", "ram_window_more", "vram_cap", "vram_head",
               "vram_window")


def _kind(d: DeviceProfile) -> int:
    if d.os == "macos":
        return MACOS_METAL if d.backend == "metal" else MACOS_CPU
    return ANDROID if d.os == "android" else LINUX


def platform(
    devices: Sequence[DeviceProfile], model: ModelProfile, *, slow_disk_bps: float = DEFAULT_SLOW_DISK_BPS
) -> Platform:
    """Compute the latency model's per-device constants (section 2.5's alpha, beta, xi and the memory limits)."""
    if not devices:
        raise ValueError("no devices to plan for")
    bp = model.layer_bytes_with_kv
    # a mixture of experts' token reads its routed experts' share only
    bp_token = bp - model.experts.unused_bytes if model.experts else bp
    kv = model.kv_bytes_per_token_layer
    hidden = model.hidden_bytes
    lookup = -(-model.input_bytes // max(model.n_vocab, 1))  # one embedding row, rounded up to whole bytes
    head_extra = lookup + model.output_bytes
    kind = np.array([_kind(d) for d in devices])
    gpu = np.array([(d.backend == "cuda" and d.os != "macos") or k == MACOS_METAL
                    for d, k in zip(devices, kind, strict=True)])
    head = np.zeros(len(devices), dtype=bool)
    head[0] = True
    t_cpu, t_gpu, m_cpu, m_gpu, copy, comm, disk = ([] for _ in range(7))
    ram_cap, vram_cap = [], []
    c_cpu, c_gpu = model.compute_buffer_cpu_bytes, model.compute_buffer_gpu_bytes
    ram_head = np.where(head, head_extra + model.output_copy_bytes + model.compute_buffer_output_bytes, 0)
    ram_window = np.where(kind == MACOS_METAL, c_cpu + c_gpu, c_cpu)
    # a window gives its CPU buffer's pages back after a prompt (engine: ContextSettings.release_compute); Metal's
    # buffers are the GPU's and are not given back
    ram_window_more = np.where(kind == MACOS_METAL, c_cpu + c_gpu, model.compute_buffer_row_bytes)
    vram_head = np.where(head & (kind == MACOS_METAL), model.output_bytes, 0)
    vram_window = np.where(gpu, c_gpu, 0)
    for i, d in enumerate(devices):
        tc = _flops_time(model.layer_flops, d.cpu_flops, d.name, "CPU")
        t_cpu.append(tc)
        gpu_rates = {q: r for q, r in d.gpu_flops.items() if r > 0}
        t_gpu.append(sum(f / gpu_rates[q] if q in gpu_rates else _flops_time({q: f}, d.cpu_flops, d.name, "CPU")
                         for q, f in model.layer_flops.items() if f > 0) if gpu[i] else tc)
        m_cpu.append(_per(kv, d.kv_copy_cpu_bps) + _per(bp_token, d.cpu_read_bps))
        m_gpu.append(_per(kv, d.kv_copy_gpu_bps) + _per(bp_token, d.gpu_read_bps))
        has_copy = gpu[i] and not d.unified_memory
        copy.append(_per(hidden, d.h2d_bps, d.copy_latency_s) + _per(hidden, d.d2h_bps, d.copy_latency_s)
                    if has_copy else 0.0)
        comm.append(_per(hidden, d.link_bps, d.link_latency_s))
        disk.append(d.disk_rand_bps if d.os == "macos" else d.disk_seq_bps)
        if kind[i] == MACOS_METAL:
            ram_cap.append(d.metal_working_set_bytes)
            vram_cap.append(d.metal_working_set_bytes)
        else:
            swap = min(d.swap_can_bytes, d.swap_free_bytes) if kind[i] == ANDROID else 0
            ram_cap.append(d.mem_available_bytes + swap)
            vram_cap.append(d.vram_free_bytes if gpu[i] else 0)
    head_dev = devices[0]
    disk_bps = np.array(disk, dtype=float)
    return Platform(
        names=tuple(d.name for d in devices), n_layer=model.n_layer, kind=kind, gpu=gpu, head=head,
        t_cpu=np.array(t_cpu), t_gpu=np.array(t_gpu), m_cpu=np.array(m_cpu), m_gpu=np.array(m_gpu),
        t_out=_flops_time(model.output_flops, head_dev.cpu_flops, head_dev.name, "CPU"),
        m_head=_per(head_extra, head_dev.cpu_read_bps),
        copy=np.array(copy), comm=np.array(comm), disk_bps=disk_bps, slow_disk=disk_bps <= slow_disk_bps,
        ram_cap=np.array(ram_cap, dtype=np.int64),
        ram_total=np.array([d.mem_total_bytes for d in devices], dtype=np.int64), ram_head=ram_head.astype(np.int64),
        ram_window=ram_window.astype(np.int64), ram_window_more=ram_window_more.astype(np.int64),
        vram_cap=np.array(vram_cap, dtype=np.int64),
        vram_head=vram_head.astype(np.int64), vram_window=vram_window.astype(np.int64),
        layer_bytes=model.layer_bytes, layer_kv_bytes=bp, head_extra=head_extra, lookup_bytes=lookup,
        expert_bytes=model.layer_expert_bytes, expert_share=model.expert_token_share, tail_layers=model.tail_layers,
        barred_starts=model.barred_starts,
    )


@dataclass(frozen=True, eq=False)
class Prediction:
    """The latency model's answer for one placement (or many: leading axes), per device on the last axis."""

    compute_s: np.ndarray
    memory_s: np.ndarray
    disk_s: np.ndarray
    network_s: np.ndarray
    ram_bytes: np.ndarray  # RAM the device's share occupies (at most what is available: the rest is re-read)
    vram_bytes: np.ndarray  # VRAM (on Metal: the part of unified memory that Metal buffers hold)
    disk_bytes: np.ndarray  # bytes re-read from disk per token
    overflows: np.ndarray  # bool: the device's share exceeds its RAM (it belongs to M1, M2 or M3 if its disk is fast)

    @property
    def device_s(self) -> np.ndarray:
        """Predicted seconds per token spent on each device."""
        return self.compute_s + self.memory_s + self.disk_s + self.network_s

    @property
    def total_s(self) -> np.ndarray:
        """Predicted time per token (Eq. 11: the sum over devices)."""
        return self.device_s.sum(axis=-1)


def ram_need(p: Platform, k: int, w: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Bytes counted against ram_cap: CPU layers (all layers on Metal's unified memory) with KV, plus fixed bytes."""
    layers = np.where(p.kind == MACOS_METAL, k * w, k * (w - n))
    return layers * p.layer_kv_bytes + p.ram_fixed(k)


def predict(p: Platform, k: int, w: np.ndarray | Sequence[int], n: np.ndarray | Sequence[int]) -> Prediction:
    """Eqs. 12-19 with Assumption 1 (every device runs k windows, l_m = k w_m, l_m^gpu = k n_m).

    A device with w = 0 is not in the ring: it costs nothing.
    """
    w = np.asarray(w, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    lg = k * n
    lc = k * w - lg
    in_ring = w > 0
    head = p.head & in_ring
    compute = lc * p.t_cpu + lg * p.t_gpu + head * p.t_out
    memory = lc * p.m_cpu + lg * p.m_gpu + k * in_ring * p.copy + head * p.m_head
    network = k * in_ring * p.comm
    need = ram_need(p, k, w, n) * in_ring
    overflows = need > p.ram_cap
    metal = p.kind == MACOS_METAL
    # Metal keeps pages until memory runs out, then re-reads the whole share each token (Eq. 16); the others
    # re-read only what does not fit (Eqs. 15, 17)
    spilled = np.where(metal, k * w * p.layer_bytes + p.head * p.head_extra, (need - p.ram_cap) * p.stream_share)
    disk_bytes = np.where(overflows, spilled, 0)
    # the head reads its token's input row from disk each token, or more when it overflows (the max in Eq. 15-17)
    read = np.maximum(disk_bytes, head * p.lookup_bytes)
    with np.errstate(divide="ignore", invalid="ignore"):
        disk = np.where(p.disk_bps > 0, read / np.where(p.disk_bps > 0, p.disk_bps, 1.0),
                        np.where(overflows, np.inf, 0.0))
    vram = np.where(lg > 0, lg * p.layer_kv_bytes + k * p.vram_window + p.vram_head, 0)
    resident = np.minimum(need, np.maximum(p.ram_cap, 0))
    vram = np.where(metal, np.minimum(vram, resident), vram)  # Metal's buffers live in the unified memory
    ram = resident - np.where(metal, vram, 0)
    return Prediction(compute_s=compute, memory_s=memory, disk_s=disk, network_s=network, ram_bytes=ram,
                      vram_bytes=vram, disk_bytes=disk_bytes, overflows=overflows)


def predict_latency(
    devices: Sequence[DeviceProfile], model: ModelProfile, k: int, w: Sequence[int], n: Sequence[int]
) -> Prediction:
    """The latency model for one placement: `devices[0]` is the head, `w[m]` layers per window on device m of
    which `n[m]` on its GPU, `k` rounds (k * sum(w) must be the model's layer count)."""
    if k * int(np.sum(w)) != model.n_layer:
        raise ValueError(f"{k} rounds of windows {list(w)} cover {k * int(np.sum(w))} layers, not {model.n_layer}")
    return predict(platform(devices, model), k, w, n)


def assign_sets(p: Platform, k: int, w: np.ndarray, n: np.ndarray, forced: np.ndarray | None = None) -> np.ndarray:
    """Algorithm 1, line 6: each device's set (M1..M4 as 0..3) from its memory use under (k, w, n).

    Slow disks and devices forced by calibration are in M4 whatever their use; the others are in their OS's
    overflow set (M1 macOS without Metal, M2 macOS with Metal, M3 Linux and Android) when their share exceeds
    their RAM, else in M4.
    """
    overflows = ram_need(p, k, np.asarray(w), np.asarray(n)) > p.ram_cap
    spill_set = np.select([p.kind == MACOS_CPU, p.kind == MACOS_METAL], [M1, M2], M3)
    keep_m4 = p.slow_disk if forced is None else (p.slow_disk | forced)
    return np.where(overflows & ~keep_m4, spill_set, M4)


def set_coefficients(p: Platform, sets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Section 2.5: a (per window layer), b (per GPU layer), c (per window) and the constant kappa, so that for a
    placement consistent with `sets` the time per token is k (a.w + b.n + sum c) + kappa."""
    s = np.where(p.disk_bps > 0, p.disk_bps, np.inf)
    share = p.stream_share  # of what spills, a token re-reads this much (M1, M3; Metal's M2 re-reads all)
    per_kv = share * p.layer_kv_bytes / s
    alpha, beta = p.alpha, p.beta
    a = alpha + np.select([sets == M1, sets == M2, sets == M3], [per_kv, p.layer_bytes / s, per_kv], 0.0)
    b = np.select([sets == M1, sets == M3], [0.0, beta - per_kv], beta)
    spill_const = np.select([(sets == M1) | (sets == M3), sets == M2],
                            [share * (p.ram_fixed(k) - p.ram_cap) / s, p.head * p.head_extra / s], 0.0)
    head_lookup = p.lookup_bytes / s[0] if sets[0] == M4 else 0.0
    kappa = p.t_out + p.m_head + float(spill_const.sum()) + head_lookup
    return a, b, p.xi.copy(), kappa


def resident_layers(p: Platform) -> tuple[np.ndarray, np.ndarray]:
    """Layers each device holds without spilling to disk, as (held by its CPU, held by its GPU).

    On Metal both share the unified memory: the first number is the total and the second the part Metal may hold.
    """
    cpu = np.maximum(p.ram_cap - p.ram_fixed(1), 0) // p.layer_kv_bytes
    gpu = np.maximum(p.vram_room(1), 0) // p.layer_kv_bytes
    return cpu, np.where(p.kind == MACOS_METAL, np.minimum(gpu, cpu), gpu)


def no_spill_capacity(p: Platform) -> np.ndarray:
    """Total layers each device holds in RAM and VRAM without re-reading any from disk."""
    cpu, gpu = resident_layers(p)
    return np.where(p.kind == MACOS_METAL, cpu, cpu + gpu)
