#!/usr/bin/env python3
"""How long Halda takes to plan a 70B-like model on 4, 8, 16 and 32 random heterogeneous home devices.

    .venv/bin/python benchmarks/scheduling_time.py [--clusters 30] [--repeats 3] [--seed 0]

Each cluster mixes GPU desktops, CPU laptops, Macs (Metal), Android phones and small boards with slow storage,
with profiles drawn around realistic figures; the head is a GPU desktop. The model has 80 layers of 0.5 GB
(Q4_K-like, KV cache for 4096 tokens). The time is that of `solve(devices, model, latency_model=...)`, device
selection included, for both latency models (the ring's, which the head uses, and the paper's Eq. 11
solved by HiGHS), after one warm-up solve each (the first loads HiGHS); per size, the median over clusters of each
cluster's best of `--repeats` runs. Writes benchmarks/results/scheduling_time.json and .png (matplotlib).
Targets (paper: 10-12 ms on 4-32 devices): median <= 10 ms at 8 devices and <= 50 ms at 32.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.scheduler import solve

OUT = Path(__file__).resolve().parent / "results"
SIZES = (4, 8, 16, 32)
TARGETS_MS = {8: 10.0, 32: 50.0}
GB = 10**9


def model_70b() -> ModelProfile:
    """A Llama-3-70B-like Q4_K profile: 80 layers of 0.5 GB, a 128k vocabulary, 8192-wide hidden states."""
    return ModelProfile(
        name="llama-70b-q4_k", n_layer=80, n_vocab=128256, n_embd=8192, layer_bytes=500_000_000,
        input_bytes=1_050_000_000, output_bytes=860_000_000,
        layer_flops={"Q4_K": 1.5e9, "Q6_K": 0.2e9, "F32": 0.03e9}, output_flops={"Q6_K": 2.1e9},
        kv_bytes_per_token_layer=2 * 2 * 8 * 128, n_kv=4096,
        compute_buffer_cpu_bytes=400_000_000, compute_buffer_gpu_bytes=600_000_000,
        compute_buffer_output_bytes=512 * 128256 * 4,  # one micro-batch of logits
    )


def _u(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi))


def random_device(rng: np.random.Generator, name: str, kind: str) -> DeviceProfile:
    """One device of a kind: "desktop" (Linux, CUDA), "laptop" (Linux, CPU), "mac" (Metal), "phone" (Android),
    "board" (Linux, CPU, SD-card storage)."""
    cpu = _u(rng, 40e9, 250e9)
    common = dict(name=name, cpu_flops={"Q4_K": cpu, "Q6_K": 0.8 * cpu, "F32": 0.5 * cpu},
                  cpu_read_bps=_u(rng, 15e9, 60e9), kv_copy_cpu_bps=_u(rng, 5e9, 20e9),
                  link_latency_s=_u(rng, 2e-3, 8e-3), link_bps=_u(rng, 40e6, 80e6), cpu_count=int(rng.integers(4, 17)))
    ram = _u(rng, 8, 64) * GB
    if kind == "desktop":
        gpu = _u(rng, 2e12, 20e12)
        return DeviceProfile(os="linux", backend="cuda", gpu_flops={"Q4_K": gpu, "Q6_K": 0.9 * gpu, "F32": 0.5 * gpu},
                             gpu_read_bps=_u(rng, 300e9, 1000e9), kv_copy_gpu_bps=_u(rng, 100e9, 500e9),
                             h2d_bps=_u(rng, 8e9, 25e9), d2h_bps=_u(rng, 8e9, 25e9), copy_latency_s=1e-5,
                             disk_seq_bps=_u(rng, 1.5e9, 6e9), disk_rand_bps=_u(rng, 0.5e9, 2e9),
                             mem_total_bytes=int(ram), mem_available_bytes=int(ram * _u(rng, 0.5, 0.8)),
                             vram_free_bytes=int(_u(rng, 6, 24) * GB), **common)
    if kind == "mac":
        uma = _u(rng, 8, 36) * GB
        gpu = _u(rng, 1e12, 6e12)
        return DeviceProfile(os="macos", backend="metal", gpu_flops={"Q4_K": gpu, "Q6_K": 0.9 * gpu, "F32": 0.5 * gpu},
                             gpu_read_bps=_u(rng, 60e9, 400e9), kv_copy_gpu_bps=_u(rng, 50e9, 200e9),
                             unified_memory=True, disk_seq_bps=_u(rng, 2e9, 6e9), disk_rand_bps=_u(rng, 1e9, 3e9),
                             mem_total_bytes=int(uma), mem_available_bytes=int(uma * _u(rng, 0.4, 0.7)),
                             metal_working_set_bytes=int(uma * 0.66), **common)
    if kind == "phone":
        mem = _u(rng, 6, 16) * GB
        return DeviceProfile(os="android", disk_seq_bps=_u(rng, 0.8e9, 2e9), disk_rand_bps=_u(rng, 0.3e9, 1e9),
                             mem_total_bytes=int(mem), mem_available_bytes=int(mem * _u(rng, 0.3, 0.5)),
                             swap_can_bytes=int(_u(rng, 0.5, 3) * GB), swap_free_bytes=int(_u(rng, 1, 4) * GB),
                             **common)
    if kind == "board":
        mem = _u(rng, 4, 8) * GB
        return DeviceProfile(os="linux", disk_seq_bps=_u(rng, 40e6, 150e6), disk_rand_bps=_u(rng, 10e6, 40e6),
                             mem_total_bytes=int(mem), mem_available_bytes=int(mem * _u(rng, 0.6, 0.9)), **common)
    return DeviceProfile(os="linux", disk_seq_bps=_u(rng, 0.5e9, 3.5e9), disk_rand_bps=_u(rng, 0.2e9, 1e9),
                         mem_total_bytes=int(ram), mem_available_bytes=int(ram * _u(rng, 0.4, 0.8)), **common)


def random_cluster(rng: np.random.Generator, size: int) -> list[DeviceProfile]:
    """`size` devices, the head (a GPU desktop) first."""
    kinds = rng.choice(["desktop", "laptop", "mac", "phone", "board"], size=size - 1, p=[0.2, 0.3, 0.2, 0.2, 0.1])
    return [random_device(rng, "head", "desktop")] + [random_device(rng, f"{k}{i}", str(k))
                                                       for i, k in enumerate(kinds, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    model = model_70b()
    models = ("ring", "paper")
    for latency_model in models:
        solve(random_cluster(rng, 4), model, latency_model=latency_model)  # warm-up: loads HiGHS, numpy parts
    results: dict[str, dict[int, dict]] = {m: {} for m in models}
    for size in SIZES:
        clusters = [random_cluster(rng, size) for _ in range(args.clusters)]
        for latency_model in models:
            times, ks, kept = [], [], []
            for devices in clusters:
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    plan = solve(devices, model, latency_model=latency_model)
                    best = min(best, time.perf_counter() - t0)
                times.append(best * 1e3)
                ks.append(plan.k)
                kept.append(len(plan.devices))
            r = results[latency_model][size] = {
                "median_ms": round(statistics.median(times), 3),
                "p90_ms": round(float(np.percentile(times, 90)), 3),
                "max_ms": round(max(times), 3),
                "median_devices_kept": statistics.median(kept),
                "k_counts": {str(k): ks.count(k) for k in sorted(set(ks))},
            }
            print(f"{latency_model:5} {size:2d} devices: median {r['median_ms']:.2f} ms, p90 {r['p90_ms']:.2f} ms, "
                  f"max {r['max_ms']:.2f} ms (devices kept: median {r['median_devices_kept']}, k {r['k_counts']})")
    met = {m: {str(n): results[m][n]["median_ms"] <= t for n, t in TARGETS_MS.items()} for m in models}
    for m in models:
        for n, t in TARGETS_MS.items():
            print(f"{m}: target <= {t:.0f} ms at {n} devices: {'met' if met[m][str(n)] else 'NOT met'}")
    OUT.mkdir(exist_ok=True)
    report = {
        "model": model.name, "n_layer": model.n_layer, "clusters_per_size": args.clusters, "repeats": args.repeats,
        "seed": args.seed, "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "results": {m: {str(k): v for k, v in r.items()} for m, r in results.items()},
        "targets_ms": {str(k): v for k, v in TARGETS_MS.items()}, "targets_met": met,
    }
    (OUT / "scheduling_time.json").write_text(json.dumps(report, indent=2) + "\n")
    _chart(results)


def _chart(results: dict[str, dict[int, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in results.items():
        sizes = list(r)
        ax.plot(sizes, [r[s]["median_ms"] for s in sizes], "o-", label=f"{m} model: median")
        ax.plot(sizes, [r[s]["p90_ms"] for s in sizes], "s--", alpha=0.5, label=f"{m} model: 90th percentile")
    ax.scatter(list(TARGETS_MS), list(TARGETS_MS.values()), marker="x", color="red", label="target")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(SIZES), [str(s) for s in SIZES])
    ax.set_xlabel("devices")
    ax.set_ylabel("solve time (ms)")
    ax.set_title("Halda planning time, 70B-like model (80 layers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "scheduling_time.png", dpi=120)


if __name__ == "__main__":
    main()
