#!/usr/bin/env python3
"""Halda against the memory- and compute-proportional baselines on an emulated heterogeneous cluster (needs root).

    sudo .venv/bin/python benchmarks/halda_testbed.py [--devices paper-d1-d4-cpu/24] [--size 1800M] [--tokens 4]

The prima.cpp paper's D1-D4 scaled down (memory and disk divided by the same factor, CPU shares differing), D1
the head, each in its own cgroup with its own model copy, joined by emulated Wi-Fi links; a synthetic llama
model larger than the devices' memory. For each scheduler, in one run: the cluster profiles itself (every
node over its control channel, the head in its own cgroup), the links are measured over the ring, the
scheduler plans, the plan is deployed, and TTFT and TPOT are measured. Halda and the baselines are scored by
the ring's latency model (the default); a fourth run has Halda minimise the paper's Eq. 11 instead. Reports
Halda's speed-up over each baseline and, for every configuration, the predicted TPOT against the measured one.
Writes benchmarks/results/halda_testbed.json and halda_testbed.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import need_charts  # noqa: E402
from benchmarks.memory_testbed import CACHE, RESULTS, model_file  # noqa: E402
from benchmarks.testbed.cgroups import CgroupUnavailableError  # noqa: E402
from benchmarks.testbed.cluster import Terminated, Testbed, unwind_on_sigterm  # noqa: E402
from benchmarks.testbed.devices import Device, load_devices  # noqa: E402
from benchmarks.testbed.timing import time_greedy  # noqa: E402

# (name, scheduler, latency model): Halda and the baselines scored by the ring's model (the default), and Halda
# minimising the paper's Eq. 11 instead, for comparison
RUNS = (("halda", "halda", "ring"), ("memory", "memory", "ring"), ("compute", "compute", "ring"),
        ("halda-paper", "halda", "paper"))


def run(scheduler: str, latency_model: str, head: Device, nodes: list[Device], model: Path, work: Path, *,
        slow_disk_bps: float, tokens: int, prompt: int, threads: int) -> dict[str, Any]:
    import primaplug
    from primaplug.head.planning import PlanSettings

    with Testbed(nodes, model, work, head=head) as tb:
        llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, scheduler=scheduler,
                              plan_settings=PlanSettings(slow_disk_bps=slow_disk_bps, latency_model=latency_model),  # type: ignore[arg-type]
                              n_ctx=512, n_batch=64,
                              n_ubatch=16, n_threads=threads, node_threads=threads, timeout_s=180, logits_all=True,
                              verbose=False)
        try:
            plan = llm.plan
            assert plan is not None
            timed = time_greedy(llm, prompt, tokens)
            statuses = {n.name: n.status(detail=True) for n in llm.cluster.nodes}
        finally:
            llm.close()
    devices = [{"name": d.name, "w": d.w, "gpu": d.n, "windows": [str(r) for r in d.windows], "set": d.device_set,
                "predicted_s": {"compute": d.compute_s, "memory": d.memory_s, "disk": d.disk_s, "network": d.network_s,
                                "faulting": d.fault_s}, "disk_bytes_per_token": d.disk_bytes,
                "major_faults_per_token": round(statuses[d.name].major_faults_per_token) if d.name in statuses
                else None}
               for d in plan.ring]
    return {"scheduler": scheduler, "latency_model": latency_model, "k": plan.k, "plan": plan.describe(),
            "devices": devices,
            "dropped": [f"{d.name}: {d.reason}" for d in plan.dropped], "predicted_tpot_s": round(plan.total_s, 3),
            **timed, "predicted_over_measured": round(plan.total_s / timed["tpot_s"], 3)}


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = list(runs)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [runs[n]["tpot_s"] for n in names], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [runs[n]["predicted_tpot_s"] for n in names], width=0.4, label="predicted (model)")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("time per output token (s)")
    ax.set_title(f"{results['model']['name']} on {len(results['devices'])} emulated devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="paper-d1-d4-cpu/24",
                    help="device file or preset[/scale]; the first device is the head (default paper-d1-d4-cpu/24)")
    ap.add_argument("--size", default="1800M")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=str(CACHE / "testbed"))
    a = ap.parse_args()
    need_charts()

    unwind_on_sigterm()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)  # llama.cpp's own log
    devices = load_devices(a.devices)
    scale = float(a.devices.partition("/")[2] or 1)
    slow_disk_bps = 400e6 / scale  # the scheduler's slow-disk threshold, scaled like the disks
    model = model_file(a.size, a.layers)
    memory = sum(d.cap_bytes for d in devices)
    print(f"{model.name}: {model.stat().st_size / 1e9:.2f} GB = {model.stat().st_size / memory:.2f}x the devices' "
          f"{memory / 1e9:.2f} GB of memory caps", file=sys.stderr)
    runs: dict[str, Any] = {}
    try:
        for s, scheduler, latency_model in RUNS:
            runs[s] = r = run(scheduler, latency_model, devices[0], devices[1:], model, Path(a.workdir),
                              slow_disk_bps=slow_disk_bps, tokens=a.tokens, prompt=a.prompt, threads=a.threads)
            print(f"  {s:<11} k={r['k']} TTFT {r['ttft_s']:6.2f} s  TPOT {r['tpot_s']:6.2f} s  predicted "
                  f"{r['predicted_tpot_s']:6.2f} s ({r['predicted_over_measured']:.2f}x)", file=sys.stderr)
            print("    " + r["plan"].replace("\n", "\n    "), file=sys.stderr)
    except CgroupUnavailableError as e:
        print(f"halda_testbed: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated):
        print("halda_testbed: interrupted; nodes stopped and cgroups removed", file=sys.stderr)
        return 130
    ratios = {"halda vs memory-proportional (target >= 2x)": runs["memory"]["tpot_s"] / runs["halda"]["tpot_s"],
              "halda vs compute-proportional (target >= 1.3x)": runs["compute"]["tpot_s"] / runs["halda"]["tpot_s"],
              "halda (ring model) vs halda (paper model)": runs["halda-paper"]["tpot_s"] / runs["halda"]["tpot_s"]}
    results = {
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {a.threads} threads",
        "model": {"name": model.name, "gb": model.stat().st_size / 1e9, "x_caps": model.stat().st_size / memory},
        "devices": [d.__dict__ | {"cap_bytes": d.cap_bytes} for d in devices], "head": devices[0].name,
        "slow_disk_bps": slow_disk_bps, "tokens": a.tokens, "prompt": a.prompt,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "predicted_over_measured (target 0.75..1.25)": {s: runs[s]["predicted_over_measured"] for s in runs},
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "halda_testbed.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, RESULTS / "halda_testbed.png")
    print("\n".join(f"{k}: {v:.2f}x" for k, v in ratios.items()), file=sys.stderr)
    print(f"wrote {RESULTS / 'halda_testbed.json'} and halda_testbed.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
