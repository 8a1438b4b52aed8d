#!/usr/bin/env python3
"""A mixture of experts larger than the cluster's memory: reading only the routed experts against reading whole
layers, and against plain llama-cpp-python (needs root: cgroups and dropping the page cache).

    sudo .venv/bin/python benchmarks/moe_streaming.py [--arch qwen3moe] [--size 640M] [--layers 16] [--experts 64]
                                                      [--used 8] [--memory-mib 150] [--disk-mbps 100] [--tokens 8]

Two emulated devices, each a real `primaplug node` in its own cgroup (memory cap, disk read cap) with its own copy
of a synthetic qwen3moe (or --arch: deepseek2, with latent attention, shared experts and grouped routing; 64 experts,
8 a token, about twice the two caps together), half the layers each; the head
(this process, uncapped) runs only the output layer. In one run, greedy decoding from a 16-token prompt:
- plain llama-cpp-python in one device's cgroup (the baseline; without repacking, as the repacked weights would be
  anonymous memory over its cap, so its kernels round their own way: the ring's tokens are checked against plain
  llama-cpp-python as it runs by default, uncapped, `reference_tokens` and `mismatch` in the JSON);
- the ring with whole layers streamed (`primaplug node --whole-experts`: every expert of every layer, prefetched
  a window ahead);
- the ring reading only the routed experts (the default: memory/experts.py);
- the same on a model whose router prefers some experts (SyntheticSpec.router_skew = 1: a quarter of the experts
  take about two thirds of the choices), where the hot set and the prediction have something to find.
For each: TPOT; per node and decoded token, the bytes read (prefetch and experts) against what the token needs
(the rest of its layers and its routed experts); how many chosen experts were resident or predicted. The bound:
what each node needs a token over its disk's rate, summed round the ring (k = 1: the devices run one after the
other). Writes benchmarks/results/moe_streaming.json and moe_streaming.png (moe_streaming-ARCH.* for another --arch).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import need_charts  # noqa: E402
from benchmarks.testbed.cluster import Testbed, testbed_script  # noqa: E402
from benchmarks.testbed.devices import Device  # noqa: E402
from benchmarks.testbed.plain import run_capped  # noqa: E402
from benchmarks.testbed.timing import time_greedy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "primaplug" / "bench"
MiB = 1 << 20
PROMPT = 16


def _byte_size(text: str) -> int:
    from primaplug.cli.synth import byte_size

    return byte_size(text)


def write_model(arch: str, size: int, layers: int, experts: int, used: int, skew: float) -> Path:
    from primaplug.engine.synthetic import write_sized_model

    path = CACHE / f"{arch}-{size >> 20}M-{layers}L-{experts}x{used}-skew{skew:g}-Q4_K_M.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"writing {path.name} (once)", file=sys.stderr)
        write_sized_model(path, size, layers, arch=arch, n_expert=experts, n_expert_used=used, router_skew=skew)
    return path


def needed_per_token(layout: Any, layers: range, chosen_bytes: float) -> float:
    """What a node needs for one decoded token: the rest of its layers, and the experts the token chose."""
    from primaplug.core import LayerRange

    rest = sum(n for _, n in layout.window_ranges(LayerRange(layers.start, layers.stop), experts=False))
    return rest + chosen_bytes


def run_ring(model: Path, devices: list[Device], workdir: Path, split: list[int], tokens: int,
             node_args: list[str]) -> dict[str, Any]:
    import primaplug
    from primaplug.engine import read_layout

    layout = read_layout(model)
    with Testbed(devices, model, workdir, node_args=node_args, links=False) as tb:
        llm = primaplug.Llama(model, nodes=tb.addresses, layers=[*split, 0], n_ctx=256, logits_all=True,
                              node_threads=1, verbose=False)
        before: list[Any] = []
        try:
            timed = time_greedy(llm, PROMPT, tokens,
                                after_prompt=lambda: before.extend(n.status(detail=True) for n in llm.cluster.nodes))
            after = [n.status(detail=True) for n in llm.cluster.nodes]
        finally:
            llm.close()
    nodes, start = [], 0
    for d, a, b, n in zip(devices, after, before, split, strict=True):
        layers = range(start, start + n)
        start += n
        read = (a.bytes_prefetched - b.bytes_prefetched) / tokens
        chosen = 0.0
        row: dict[str, Any] = {"name": d.name, "layers": [layers.start, layers.stop], "memory_mode": a.memory_mode,
                               "major_faults_per_token": round(a.major_faults_per_token, 1)}
        if a.experts is not None and b.experts is not None:
            e, f = a.experts, b.experts
            read += (e.bytes_read - f.bytes_read) / tokens
            chosen = (e.bytes_chosen - f.bytes_chosen) / tokens
            n_chosen = max(1, e.chosen - f.chosen)
            row.update(resident_share=round((e.resident - f.resident) / n_chosen, 3),
                       predicted_share=round((e.predicted - f.predicted) / n_chosen, 3))
        else:  # whole layers: the experts a token chose are those of the same model read the other way
            chosen = layout.n_expert_used * sum(layout.expert_bytes(il) for il in layers)
        need = needed_per_token(layout, layers, chosen)
        row.update(read_mib_per_token=round(read / MiB, 2), needed_mib_per_token=round(need / MiB, 2),
                   read_over_needed=round(read / need, 3) if need else None,
                   bound_s=round(need / (d.disk_mbps * 1e6), 3))
        nodes.append(row)
    bound = sum(r["bound_s"] for r in nodes)
    return {**timed, "nodes": nodes, "bound_s": round(bound, 3),
            "tpot_over_bound": round(timed["tpot_s"] / bound, 2) if bound else None}


def reference_tokens(model: Path, tokens: int) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    try:
        return time_greedy(llm, PROMPT, tokens)["tokens"]
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe", choices=("qwen3moe", "deepseek2", "glm4moe", "qwen35moe"))
    ap.add_argument("--size", type=_byte_size, default=_byte_size("640M"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--memory-mib", type=float, default=150, help="each device's memory for the model")
    ap.add_argument("--disk-mbps", type=float, default=100, help="each device's disk reads")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--skip-plain", action="store_true")
    args = ap.parse_args()
    need_charts()

    with testbed_script("moe_streaming"):
        from primaplug.engine import read_layout

        devices = [Device(f"d{i + 1}", args.memory_mib, args.disk_mbps, cpus=1.0) for i in range(2)]
        half = args.layers // 2
        split = [half, args.layers - half]
        workdir = CACHE / "moe-testbed"
        uniform = write_model(args.arch, args.size, args.layers, args.experts, args.used, 0.0)
        skewed = write_model(args.arch, args.size, args.layers, args.experts, args.used, 1.0)
        layout = read_layout(uniform)
        caps = sum(d.memory_mib for d in devices) * MiB
        results: dict[str, Any] = {
            "machine": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args),
            "model": {"file": uniform.name, "bytes": layout.file_size, "over_caps": round(layout.file_size / caps, 2),
                      "n_expert": layout.n_expert, "n_expert_used": layout.n_expert_used,
                      # the first layer with experts (deepseek2's first is dense)
                      "expert_mib": round(max(layout.expert_bytes(il) for il in range(layout.n_layer)) / MiB, 3)},
            "devices": [vars(d) for d in devices], "runs": {}}
        runs = results["runs"]
        if not args.skip_plain:
            print("plain llama-cpp-python, capped like one device", file=sys.stderr)
            runs["plain"] = run_capped(devices[0], uniform, workdir, tokens=args.tokens, threads=1, n_ctx=256,
                                       prompt=PROMPT)
        for name, model, node_args in (("whole layers", uniform, ["--whole-experts"]),
                                       ("routed experts", uniform, []),
                                       ("routed experts, skewed router", skewed, []),
                                       ("whole layers, skewed router", skewed, ["--whole-experts"])):
            print(f"ring: {name}", file=sys.stderr)
            runs[name] = run_ring(model, devices, workdir, split, args.tokens, node_args)
        whole, experts = runs["whole layers"]["tpot_s"], runs["routed experts"]["tpot_s"]
        results["ratios"] = {"whole_over_experts": round(whole / experts, 2)}
        if "plain" in runs and runs["plain"].get("tpot_s"):
            results["ratios"]["plain_over_experts"] = round(runs["plain"]["tpot_s"] / experts, 2)
        # the tokens: plain llama-cpp-python as it runs by default (repacking its weights; uncapped, in this
        # process), whose kernels the nodes' repacked copies use. The capped baseline above does not repack (the
        # repacked copy would be anonymous memory over its cap), so it rounds its own way.
        results["reference_tokens"] = {"uniform": reference_tokens(uniform, args.tokens),
                                       "skewed": reference_tokens(skewed, args.tokens)}
        results["mismatch"] = [name for name, r in runs.items() if name != "plain" and r["tokens"] !=
                               results["reference_tokens"]["skewed" if "skewed" in name else "uniform"]]
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / ("moe_streaming" + ("" if args.arch == "qwen3moe" else f"-{args.arch}"))
        (out.with_suffix(".json")).write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({k: results[k] for k in ("model", "ratios", "mismatch")}, indent=1))
        for name, r in runs.items():
            extra = "" if name == "plain" else f", bound {r['bound_s']} s, nodes " + "; ".join(
                f"{n['name']} read {n['read_mib_per_token']} MiB/token of {n['needed_mib_per_token']} needed"
                + (f", {n['resident_share']:.0%} resident, {n['predicted_share']:.0%} predicted"
                   if "resident_share" in n else "") for n in r["nodes"])
            print(f"{name}: TPOT {r.get('tpot_s')} s{extra}")
        _chart(results, out.with_suffix(".png"))


def _chart(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = [n for n in runs if runs[n].get("tpot_s")]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(names)), [runs[n]["tpot_s"] for n in names], color="#4c72b0")
    for i, n in enumerate(names):
        if "bound_s" in runs[n]:
            ax.hlines(runs[n]["bound_s"], i - 0.4, i + 0.4, colors="#c44e52", label="bound" if i == 1 else None)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
    ax.set_ylabel("TPOT (s)")
    m = results["model"]
    ax.set_title(f"{results['args']['arch']} {m['bytes'] / 1e6:.0f} MB ({m['over_caps']}x the caps), "
                 f"{m['n_expert']} experts, {m['n_expert_used']} a token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
