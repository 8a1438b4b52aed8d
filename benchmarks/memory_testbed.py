#!/usr/bin/env python3
"""Prefetch and release on an emulated home cluster (needs root: cgroups and dropping the page cache).

    sudo .venv/bin/python benchmarks/memory_testbed.py [--devices paper-d1-d4/24] [--size 1800M] [--tokens 4]

Four emulated devices (the prima.cpp paper's D1-D4, memory and disk speed divided by the same factor), each a
real `primaplug node` in its own cgroup (memory cap, disk read cap) with its own copy of a synthetic llama model
at least 1.5x the sum of the caps, joined by emulated Wi-Fi links (3-7 ms). In one run:
- plain llama-cpp-python on one device capped like the largest node (the paper's llama.cpp baseline);
- the ring with k = 1 and with the best k >= 2, each with prefetch and release (the default: whole windows, or layer
  by layer where a whole window would fault much of itself in), without prefetch, without release, without both,
  and with whole windows always (--layer-streaming=off); the windows for each k chosen by
  the ring's latency model (scheduler/ring.py) from the devices' caps, disk and CPU shares and links (a device
  may be a relay), the head (this process, uncapped) running only the output layer (--split hand: memory
  first, the rest by disk speed, every device at least one layer per round, as before session 4);
- on a smaller model that fits the caps: the ring with the memory policy on and with every part of it off.
TTFT, TPOT, per-node major faults per token and memory pressure for each; the ratios the targets name.
Writes benchmarks/results/memory_testbed.json and memory_testbed.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import need_charts  # noqa: E402
from benchmarks.testbed.bound import pooled_disk_bound, tpot_bound  # noqa: E402
from benchmarks.testbed.cgroups import CgroupUnavailableError  # noqa: E402
from benchmarks.testbed.cluster import Terminated, Testbed, unwind_on_sigterm  # noqa: E402
from benchmarks.testbed.devices import Device, load_devices  # noqa: E402
from benchmarks.testbed.memwatch import MemoryWatch, growth  # noqa: E402
from benchmarks.testbed.plain import run_capped  # noqa: E402
from benchmarks.testbed.timing import time_greedy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "primaplug" / "bench"
# "prefetch+release" is the default: whole windows, or layer by layer where a whole window would fault much of
# itself in (--layer-streaming auto); "whole windows" never goes layer by layer
VARIANTS = {"prefetch+release": [], "no prefetch": ["--no-prefetch"], "no release": ["--no-release"],
            "neither": ["--no-prefetch", "--no-release"],
            "whole windows": ["--layer-streaming=off"]}
ALL_OFF = ["--no-prefetch", "--no-release", "--no-keep"]


def ring_platform(devices: list[Device], model: Path, available: list[int] | None = None) -> Any:
    """The ring's latency model's constants for what the testbed gives the devices (memory, disk read cap, CPU
    share, link) and this machine's measured compute (its cached profile). Memory: `available`, what each running
    node has (Testbed.available_bytes: its cap less its runtime, as a node reports it to Halda), else memory_mib
    (the cap less RUNTIME_MIB, before the nodes run). The head is this process, not capped: it plays a device with
    no memory and no disk, which runs only the output layer."""
    import os

    import msgspec

    from primaplug.engine import read_layout
    from primaplug.profiler.device import profile_device
    from primaplug.profiler.model import model_types, profile_model
    from primaplug.scheduler.latency import platform

    mp = profile_model(read_layout(model), n_ctx=512, n_batch=64, n_ubatch=16)
    here = profile_device("this machine", model_types=model_types(mp))
    cores = os.cpu_count() or 1

    def device(name: str, memory: int, disk: float, cpus: float, latency_s: float, bps: float):  # noqa: ANN202
        return msgspec.structs.replace(
            here, name=name, mem_total_bytes=memory, mem_available_bytes=memory, disk_seq_bps=disk,
            disk_rand_bps=disk, cpu_flops={q: f * min(1.0, cpus / cores) for q, f in here.cpu_flops.items()},
            link_latency_s=latency_s, link_bps=bps)

    head = device("head", 0, 0.0, cores, 1e-4, 1e10)
    memory = available or [int(d.memory_mib * (1 << 20)) for d in devices]
    nodes = [device(d.name, m, d.read_bps, d.cpus or cores, d.link_latency_ms / 1e3, d.link_mbit * 1e6 / 8)
             for d, m in zip(devices, memory, strict=True)]
    return platform([head, *nodes], mp, slow_disk_bps=0.0)


def model_windows(p: Any, rounds: int) -> list[int]:
    """Layers per round of each device, chosen by the ring's latency model (p: ring_platform). A device may be left
    a relay (no layer) where that is faster, as Halda's device selection would."""
    from primaplug.scheduler.ring import best_placement

    found = best_placement(p, rounds, relays=True)
    if found is None:
        raise SystemExit(f"the ring's latency model found no placement with k = {rounds}")
    return list(found.w[1:])


def running_windows(tb: Testbed, devices: list[Device], model: Path, rounds: int) -> tuple[Any, list[int]]:
    """The ring model's platform for the running testbed's nodes (their own memory, as they report it to Halda)
    and the windows it chooses with k = rounds."""
    p = ring_platform(devices, model, tb.available_bytes())
    return p, model_windows(p, rounds)


def predicted_tpot(p: Any, rounds: int, sizes: list[int]) -> float:
    """What the ring's latency model (p: ring_platform) predicts for these windows, the head running only the
    output layer."""
    import numpy as np

    from primaplug.scheduler.ring import gpu_layers, predict_ring

    w = np.array([[0, *sizes]])
    return float(np.atleast_1d(predict_ring(p, rounds, w, gpu_layers(p, rounds, w)).total_s)[0])


def mean_layer_bytes(layout: Any) -> float:
    return sum(layout.layer_bytes(il) for il in range(layout.n_layer)) / layout.n_layer


def device_bytes(layout: Any, rounds: int, sizes: Sequence[int]) -> list[int]:
    """Each device's weights a token for `sizes` layers per round, every layer at the model's average (what the
    bound is given: testbed/bound.py)."""
    return [int(n * rounds * mean_layer_bytes(layout)) for n in sizes]


def memory_then_disk(devices: list[Device], layer_bytes: float, per_round: int, rounds: int) -> list[int]:
    """Hand-made windows (--split hand): each device first gets the layers its memory holds, the rest go in
    proportion to disk speed, so that the devices' streaming takes about equally long."""
    fit = [0.8 * d.memory_mib * (1 << 20) / layer_bytes / rounds for d in devices]
    rest = max(0.0, per_round - sum(fit))
    speed = sum(d.disk_mbps for d in devices)
    return proportional([f + rest * d.disk_mbps / speed for f, d in zip(fit, devices, strict=True)], per_round)


def proportional(weights: list[float], total: int) -> list[int]:
    """`total` layers split in proportion to `weights`, at least one each (largest remainders)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [max(1, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(out) < total:
        out[order[i % len(out)]] += 1
        i += 1
    while sum(out) > total:
        j = max((j for j in range(len(out)) if out[j] > 1), key=lambda j: out[j] - raw[j])
        out[j] -= 1
    return out


def model_file(size: str, layers: int, *, shallow: int = 0, deep_scale: float = 1.0) -> Path:
    """The synthetic llama of `size` with `layers` layers, written once and cached; `shallow`/`deep_scale`: its
    layers past the first `shallow` scaled (engine/synthetic.py: SyntheticSpec.shallow_layers)."""
    from primaplug.cli.synth import byte_size as _byte_size
    from primaplug.engine.synthetic import write_sized_model

    tuned = f"-shallow{shallow}-deep{deep_scale:g}" if shallow else ""
    path = CACHE / f"llama-{layers}L-{size}{tuned}-Q4_K_M.gguf"
    if not path.exists():
        print(f"writing {path.name} (once; primaplug synth)", file=sys.stderr)
        CACHE.mkdir(parents=True, exist_ok=True)
        write_sized_model(path, _byte_size(size), layers, shallow_layers=shallow, deep_scale=deep_scale)
    return path


def ring_run(devices: list[Device], model: Path, work: Path, *, rounds: int, flags: list[str], tokens: int,
             prompt: int, threads: int, split: str = "model", rooms: str = "plan") -> dict[str, Any]:
    """`rooms`: "plan", each streaming node's room as the plan chooses it from the ring's timing
    (scheduler/rooms.py), or "own", each node's own rule."""
    import numpy as np

    import primaplug
    from primaplug.engine import read_layout
    from primaplug.scheduler.rooms import choose_rooms

    layout = read_layout(model)
    layer_bytes = mean_layer_bytes(layout)
    with Testbed(devices, model, work, node_args=flags) as tb, MemoryWatch(tb.groups) as watch:
        p = ring_platform(devices, model, tb.available_bytes())
        sizes = (model_windows(p, rounds) if split == "model"
                 else memory_then_disk(devices, layer_bytes, layout.n_layer // rounds, rounds))
        w = np.array([0, *sizes])
        chosen = choose_rooms(p, rounds, w, np.zeros_like(w))  # the head first, as ring_platform has it
        stream_rooms = list(chosen.rooms[1:]) if rooms == "plan" else [0] * len(sizes)
        t0 = time.perf_counter()
        llm = primaplug.Llama(model, nodes=tb.addresses, route=tb.route, layers=[*sizes, 0], rounds=rounds,
                              stream_rooms=stream_rooms,
                              n_ctx=512, n_batch=64, n_ubatch=16, n_threads=threads, node_threads=threads,
                              timeout_s=120, logits_all=True, verbose=False)
        deployed = time.perf_counter() - t0
        watch.mark("deployed")
        try:
            timed = time_greedy(llm, prompt, tokens, after_prompt=lambda: watch.mark("prompt"))
            watch.mark("decoded")
            statuses = [n.status(detail=True) for n in llm.cluster.nodes]
            processes = watch.processes()
        finally:
            llm.close()
        peaks = tb.peak_memory_bytes()
    memory = watch.summary()
    ring_model = predicted_tpot(p, rounds, sizes)
    # what the plan predicts (Plan.total_s): round by round where it sent rooms, else the ring model
    predicted = chosen.tpot_s if any(stream_rooms) else ring_model
    return {
        "rounds": rounds, "layers_per_round": sizes, "flags": flags, "deploy_s": round(deployed, 2), **timed,
        "predicted_tpot_s": round(predicted, 3), "measured_over_predicted": round(timed["tpot_s"] / predicted, 3),
        # the rooms sent (0: the node's own rule); the ring model, and the per-round model (scheduler/rooms.py)
        # with each node's own rule
        "stream_rooms": stream_rooms, "ring_model_tpot_s": round(ring_model, 3),
        "round_model_own_rule_tpot_s": round(chosen.own_rule_s, 3),
        "device_bytes": device_bytes(layout, rounds, sizes),
        "nodes": [{"name": d.name, "memory_mode": s.memory_mode,
                   "major_faults_per_token": round(s.major_faults_per_token, 1),
                   "memory_pressure": round(s.memory_pressure, 4), "bytes_prefetched": s.bytes_prefetched,
                   "bytes_released": s.bytes_released, "resident_bytes": s.resident_bytes,
                   "cap_bytes": d.cap_bytes, "peak_bytes": p,
                   "growth_since_start": growth(memory[d.name], d.cap_bytes), "memory": memory[d.name],
                   "anonymous_by_mapping": processes[d.name]}
                  for d, s, p in zip(devices, statuses, peaks, strict=True)],
    }


def compute_rate(model: Path, threads: int, prompt: int) -> float:
    """Seconds per byte of weights plain llama-cpp-python takes to decode a model that fits (uncapped)."""
    from primaplug.engine import read_layout
    from primaplug.engine.reference import plain_llama

    layout = read_layout(model)
    with plain_llama(model, n_ctx=512, n_threads=threads, n_threads_batch=threads, logits_all=True,
                     verbose=False) as llm:
        timed = time_greedy(llm, prompt, 16)
    return timed["tpot_s"] / sum(layout.layer_bytes(il) for il in range(layout.n_layer))


def _line(name: str, r: dict[str, Any]) -> None:
    nodes = " ".join(f"{n['major_faults_per_token']:.0f}f/{n['memory_pressure']:.1%}" for n in r.get("nodes", []))
    pred = f" (predicted {r['predicted_tpot_s']:.2f})" if "predicted_tpot_s" in r else ""
    if "stream_rooms" in r:
        pred += (f" (ring model {r['ring_model_tpot_s']:.2f}, own rule round by round "
                 f"{r['round_model_own_rule_tpot_s']:.2f}; rooms {' '.join(map(str, r['stream_rooms']))})")
    print(f"  {name:<34} TTFT {r['ttft_s']:7.2f} s  TPOT {r['tpot_s']:7.2f} s{pred}  {nodes}", file=sys.stderr)


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = list(runs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    ax1.barh(names, [runs[n]["tpot_s"] for n in names], color=["#888" if n.startswith("plain") else "#3b7dd8"
                                                                for n in names])
    ax1.set_xlabel("time per output token (s), lower is better")
    ax1.invert_yaxis()
    ax1.set_title(f"{results['model']['name']} ({results['model']['gb']:.2f} GB) on {len(results['devices'])} "
                  "emulated devices")
    ring = [n for n in names if "nodes" in runs[n]]
    devs = [d["name"] for d in results["devices"]]
    width = 0.8 / len(devs)
    for j, d in enumerate(devs):
        ax2.barh([i + j * width for i in range(len(ring))],
                 [runs[n]["nodes"][j]["memory_pressure"] * 100 for n in ring], height=width, label=d)
    ax2.set_yticks([i + 0.4 - width / 2 for i in range(len(ring))], ring)
    ax2.invert_yaxis()
    ax2.axvline(6, color="red", linestyle="--", linewidth=1, label="6% target")
    ax2.set_xlabel("memory pressure per node (%)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_testbed_args(ap: argparse.ArgumentParser) -> None:
    """The devices and the model larger than their memory (this benchmark's, and benchmarks/verify_cost.py's)."""
    ap.add_argument("--devices", default="paper-d1-d4/24",
                    help="device file or preset[/scale] (default paper-d1-d4/24)")
    ap.add_argument("--size", default="1800M", help="synthetic model size (default 1800M)")
    ap.add_argument("--layers", type=int, default=32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_testbed_args(ap)
    ap.add_argument("--fit-size", default="300M", help="the model that fits the caps (default 300M)")
    ap.add_argument("--tokens", type=int, default=4, help="decoded tokens per run (default 4)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--rounds", default="2,4,8", help="k >= 2 to try (default 2,4,8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--split", choices=("model", "hand"), default="model",
                    help="windows chosen by the ring's latency model (default) or by hand (memory, then disk)")
    ap.add_argument("--fit-trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="prefetch and release only: no ablations (about a third of the time)")
    ap.add_argument("--ring-only", metavar="K,K", help="only the ring at these k, with --node-flag; prints, writes "
                    "nothing (for comparing node flags)")
    ap.add_argument("--ring-only-json", metavar="FILE", help="with --ring-only: the last run's record, to FILE")
    ap.add_argument("--node-flag", action="append", default=[], help="a flag for every node (with --ring-only)")
    ap.add_argument("--rooms", choices=("plan", "own"), default="plan",
                    help="each streaming node's room: as the plan chooses it from the ring's timing (default), or "
                    "each node's own rule (a window's layers and one), for comparisons")
    ap.add_argument("--memory-factor", type=float, default=1.0,
                    help="multiply every device's memory (2: the second device set of docs/memory.md)")
    ap.add_argument("--workdir", default=str(CACHE / "testbed"), help="model copies and node logs")
    a = ap.parse_args()
    need_charts()

    unwind_on_sigterm()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)  # llama.cpp's own log
    devices = [dataclasses.replace(d, memory_mib=d.memory_mib * a.memory_factor) for d in load_devices(a.devices)]
    model, small = model_file(a.size, a.layers), model_file(a.fit_size, 16)
    caps = sum(d.cap_bytes for d in devices)
    print(f"{model.name}: {model.stat().st_size / 1e9:.2f} GB = {model.stat().st_size / caps:.2f}x the caps' "
          f"{caps / 1e9:.2f} GB", file=sys.stderr)
    work = Path(a.workdir)
    kw = dict(tokens=a.tokens, prompt=a.prompt, threads=a.threads, split=a.split, rooms=a.rooms)
    runs: dict[str, Any] = {}
    if a.ring_only:
        for k in (int(x) for x in a.ring_only.split(",")):
            r = ring_run(devices, model, work, rounds=k, flags=a.node_flag, **kw)
            _line(f"k={k} {' '.join(a.node_flag)} (layers per round {' '.join(map(str, r['layers_per_round']))})", r)
            if a.ring_only_json:
                Path(a.ring_only_json).write_text(json.dumps(r, indent=2) + "\n")
        return 0
    s_per_byte = compute_rate(small, a.threads, a.prompt)
    print(f"  compute: plain llama-cpp-python decodes {1 / s_per_byte / 1e9:.2f} GB of weights a second "
          f"(uncapped, {small.name})", file=sys.stderr)
    try:
        largest = max(devices, key=lambda d: d.memory_mib)
        repacked = run_capped(largest, model, work / "plain", tokens=1, threads=a.threads, n_ctx=512, prompt=a.prompt,
                              repack=True)
        print(f"  plain llama-cpp-python as it ships (repacking weights) on {largest.name}: "
              f"{'killed: out of memory' if repacked.get('killed') else 'ran'}", file=sys.stderr)
        runs[f"plain llama-cpp-python on {largest.name}"] = r = run_capped(
            largest, model, work / "plain", tokens=a.tokens, threads=a.threads, n_ctx=512, prompt=a.prompt)
        if r.get("killed"):
            raise SystemExit("plain llama-cpp-python without repacking was killed too: the cap is too small")
        _line(f"plain on {largest.name}", r)
        variants = dict(list(VARIANTS.items())[:1]) if a.quick else VARIANTS
        for name, flags in variants.items():
            runs[f"k=1 {name}"] = r = ring_run(devices, model, work, rounds=1, flags=flags, **kw)
            _line(f"k=1 {name}", r)
        best = None
        for k in (int(x) for x in a.rounds.split(",")):
            if a.layers % k or a.layers // k < len(devices):
                continue
            runs[f"k={k} prefetch+release"] = r = ring_run(devices, model, work, rounds=k, flags=[], **kw)
            _line(f"k={k} prefetch+release", r)
            if best is None or r["tpot_s"] < runs[f"k={best} prefetch+release"]["tpot_s"]:
                best = k
        for name, flags in list(variants.items())[1:]:
            runs[f"k={best} {name}"] = r = ring_run(devices, model, work, rounds=best, flags=flags, **kw)
            _line(f"k={best} {name}", r)
        fit: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(a.fit_trials):  # interleaved, so that drift on the machine hits both alike
            for key, flags in (("on", []), ("off", ALL_OFF)):
                r = ring_run(devices, small, work, rounds=1, flags=flags, tokens=16, prompt=a.prompt, threads=a.threads)
                fit[key].append(r["tpot_s"])
                runs.setdefault(f"fits, memory policy {key}", r)
    except CgroupUnavailableError as e:
        print(f"memory_testbed: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated):
        print("memory_testbed: interrupted; nodes stopped and cgroups removed", file=sys.stderr)
        return 130

    def tpot(name: str) -> float:
        return runs[name]["tpot_s"] if name in runs else float("nan")  # an ablation --quick left out

    plain = tpot(next(n for n in runs if n.startswith("plain")))
    for r in runs.values():
        if "device_bytes" in r:
            b = tpot_bound(devices, r["device_bytes"], s_per_byte, r["rounds"])
            r["bound"], r["x_bound"] = b.as_dict(), round(r["tpot_s"] / b.tpot_s, 3)
    from primaplug.engine import read_layout

    big = read_layout(model)
    disks = pooled_disk_bound(devices, sum(big.layer_bytes(il) for il in range(big.n_layer)))
    best_run = runs[f"k={best} prefetch+release"]
    ratios = {
        "best configuration against its bound (target <= 1.2x)": best_run["x_bound"],
        "ring vs plain, as a share of the most the disks allow (target >= 0.85)":
            (plain / best_run["tpot_s"]) / (plain / disks),
        "ring k=best prefetch+release vs plain (target >= 5x)": plain / tpot(f"k={best} prefetch+release"),
        "k=best vs k=1, both prefetch+release (target >= 1.8x)":
            tpot("k=1 prefetch+release") / tpot(f"k={best} prefetch+release"),
        "prefetch vs no prefetch at k=best (target >= 1.15x)":
            tpot(f"k={best} no prefetch") / tpot(f"k={best} prefetch+release"),
        "prefetch vs no prefetch at k=1": tpot("k=1 no prefetch") / tpot("k=1 prefetch+release"),
        "release vs no release at k=best": tpot(f"k={best} no release") / tpot(f"k={best} prefetch+release"),
        "default (auto layer streaming) vs whole windows at k=1":
            tpot("k=1 whole windows") / tpot("k=1 prefetch+release"),
        f"default (auto layer streaming) vs whole windows at k={best}":
            tpot(f"k={best} whole windows") / tpot(f"k={best} prefetch+release"),
        "the ring model's measured/predicted TPOT, worst over every k (target within 0.8-1.2)": max(
            (r["measured_over_predicted"] for n, r in runs.items()
             if n.startswith("k=") and n.endswith("prefetch+release")), key=lambda x: abs(x - 1)),
        "fits: policy on vs off, median TPOT (target within 3%)":
            statistics.median(fit["on"]) / statistics.median(fit["off"]),
    }
    pressure = max(n["memory_pressure"] for r in runs.values() for n in r.get("nodes", []) if "fits" not in r)
    # what the product runs (prefetch and release on), apart from the ablations that turn a part off
    product = max(n["memory_pressure"] for name, r in runs.items() if name.endswith("prefetch+release")
                  for n in r["nodes"])
    results = {
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {a.threads} threads",
        "model": {"name": model.name, "gb": model.stat().st_size / 1e9, "x_caps": model.stat().st_size / caps},
        "fit_model": {"name": small.name, "gb": small.stat().st_size / 1e9},
        "devices": [d.__dict__ | {"cap_bytes": d.cap_bytes} for d in devices],
        "tokens": a.tokens, "prompt": a.prompt, "best_k": best, "fit_tpot_s": fit,
        "plain_as_shipped_killed_by_cap": bool(repacked.get("killed")),
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "compute_s_per_gb": round(s_per_byte * 1e9, 4), "disks_bound_tpot_s": round(disks, 3),
        "memory_factor": a.memory_factor,
        "max_memory_pressure": round(pressure, 4),
        "max_memory_pressure_prefetch_release": round(product, 4),
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = "memory_testbed" if a.memory_factor == 1 else f"memory_testbed_memory_x{a.memory_factor:g}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, RESULTS / f"{stem}.png")
    print("\n".join(f"{k}: {v:.2f}x" for k, v in ratios.items()), file=sys.stderr)
    print(f"largest memory pressure on a node with prefetch and release, every k (target <= 6%): {product:.1%}",
          file=sys.stderr)
    print(f"largest memory pressure on a node, ablations included: {pressure:.1%}", file=sys.stderr)
    print(f"wrote {RESULTS / stem}.json and {stem}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
