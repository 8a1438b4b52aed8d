"""The two heuristic schedulers the paper compares Halda with (appendix A.10), both with one round (k = 1).

- memory-proportional (MemSched, exo's rule): layers in proportion to each device's memory (RAM, plus VRAM on a
  CUDA device; Metal's working set on a Mac with Metal).
- compute-proportional with OOM migration (PerfSched, Galaxy's rule): layers in proportion to compute speed;
  layers a device cannot hold without spilling move to the fastest devices with room; what still does not fit
  is spread over the CPUs in proportion to their speed (the paper's greedy fallback: those devices spill).

Neither looks at disks, links or OS memory behaviour: that is what they are baselines for. On a device with a
GPU, as many of its layers as the VRAM holds (Eqs. 34-35 with k = 1) run on the GPU, the rest on the CPU.
"""

from __future__ import annotations

import numpy as np

from primaplug.scheduler.halda import apportion, gpu_layer_cap
from primaplug.scheduler.latency import MACOS_METAL, Platform, no_spill_capacity


def gpu_fill(p: Platform, w: np.ndarray) -> np.ndarray:
    """GPU layers per window with one round: as many of each device's layers as its VRAM holds."""
    return np.minimum(w, gpu_layer_cap(p, 1))


def memory_proportional(p: Platform) -> tuple[np.ndarray, np.ndarray]:
    """MemSched: (w, n) with w in proportion to RAM + VRAM (at least one layer each)."""
    vram = np.where(p.gpu & (p.kind != MACOS_METAL), p.vram_cap, 0)
    w = apportion(np.maximum(p.ram_cap, 0) + vram, p.n_layer)
    return w, gpu_fill(p, w)


def compute_speed(p: Platform) -> np.ndarray:
    """Layers per second of compute on each device's faster backend (FLOP terms only, as Galaxy ranks devices)."""
    per_layer = np.where(p.gpu, np.minimum(p.t_cpu, p.t_gpu), p.t_cpu)
    return 1.0 / np.maximum(per_layer, 1e-30)


def compute_proportional(p: Platform) -> tuple[np.ndarray, np.ndarray]:
    """PerfSched: (w, n) with w in proportion to compute speed, then overflowing layers migrated."""
    speed = compute_speed(p)
    w = apportion(speed, p.n_layer)
    cap = np.maximum(no_spill_capacity(p), 1)
    excess = int(np.maximum(w - cap, 0).sum())
    w = np.minimum(w, cap)
    for i in np.argsort(-speed, kind="stable"):
        take = min(int(cap[i] - w[i]), excess)
        w[i] += take
        excess -= take
    if excess:
        w = w + apportion(1.0 / np.maximum(p.t_cpu, 1e-30), excess, minimum=0)
    return w, gpu_fill(p, w)
