#!/usr/bin/env python3
"""What the memory policy can reach on the emulated home cluster, whatever the split: every split of every k priced
by the per-round model (scheduler/rooms.py) with its best rooms, against the two bounds the memory testbed reports.

    .venv/bin/python benchmarks/policy_bound.py        # about a minute; reads the memory testbed's committed JSON

The per-round model prices what a streaming device must do: keep a part of every layer, leave room for what it
reads ahead, and read in its own turn what that room could not hold. Its predictions were within 1.00-1.15 of the
testbed's measured TPOT at every k on both device sets (docs/memory.md, "Measured"). The bounds leave the room out:
a device's bound reads only what its memory cannot hold, as if it needed no room to read it into. So the least the
per-round model finds over every split says how close to the bounds this policy can come on these devices; the
rest of the gap is the room.

Per device set (the paper's devices, and with twice the memory): for k = 1, 2, 4, 8 the split the testbed runs (the
ring model's), the fastest split by the per-round model, each with its rooms, prediction and bound; then the best
over every k against the pooled disks' bound (the testbed's "ring vs plain, as a share of the most the disks allow"
is pooled / TPOT). Writes benchmarks/results/policy_bound.json.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_testbed import device_bytes, model_file, model_windows, ring_platform  # noqa: E402
from benchmarks.testbed.bound import pooled_disk_bound, tpot_bound  # noqa: E402
from benchmarks.testbed.devices import load_devices  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MiB = 1 << 20
SETS = {1.0: "memory_testbed.json", 2.0: "memory_testbed_memory_x2.json"}


def node_start_bytes(testbed: dict[str, Any]) -> list[int]:
    """What each node used at its start in the testbed's run (its runtime): the planner sees the cap less this."""
    run = next(r for r in testbed["runs"].values() if r.get("nodes") and r["nodes"][0].get("memory"))
    return [int(n["memory"]["marks"][0]["used"] * MiB) for n in run["nodes"]]


def one_set(factor: float) -> dict[str, Any]:
    import numpy as np

    from primaplug.engine import read_layout
    from primaplug.scheduler.rooms import choose_rooms

    path = RESULTS / SETS[factor]
    if not path.exists():
        raise SystemExit(f"policy_bound: {path} is missing: run benchmarks/memory_testbed.py"
                         f"{'' if factor == 1 else f' --memory-factor {factor:g}'} first (as root)")
    testbed = json.loads(path.read_text())
    devices = [dataclasses.replace(d, memory_mib=d.memory_mib * factor) for d in load_devices("paper-d1-d4/24")]
    model = model_file("1800M", 32)
    layout = read_layout(model)
    p = ring_platform(devices, model, [d.cap_bytes - s for d, s in zip(devices, node_start_bytes(testbed),
                                                                         strict=True)])
    s_per_byte = testbed["compute_s_per_gb"] / 1e9

    pooled = pooled_disk_bound(devices, sum(layout.layer_bytes(il) for il in range(layout.n_layer)))

    def priced(k: int, split: tuple[int, ...]) -> dict[str, Any]:
        w = np.array([0, *split])
        r = choose_rooms(p, k, w, np.zeros_like(w))
        bound = tpot_bound(devices, device_bytes(layout, k, split), s_per_byte, k)
        return {"layers_per_round": list(split), "rooms": [int(x) for x in r.rooms[1:]],
                "predicted_s": round(r.tpot_s, 3), "bound_s": round(bound.tpot_s, 3),
                "predicted_over_bound": round(r.tpot_s / bound.tpot_s, 3)}

    per_k: dict[str, Any] = {}
    for k in (1, 2, 4, 8):
        per = layout.n_layer // k
        splits = [tuple(int(x) for x in np.diff((0, *cuts, per)))
                  for cuts in itertools.combinations_with_replacement(range(per + 1), len(devices) - 1)]
        every = sorted((priced(k, s) for s in splits), key=lambda x: x["predicted_s"])
        measured = testbed["runs"].get(f"k={k} prefetch+release", {})
        # the split the testbed ran (the ring model's from the nodes' memory then), else the one it would choose now
        tested = tuple(measured.get("layers_per_round") or model_windows(p, k))
        per_k[f"k={k}"] = {"tested": priced(k, tested), "fastest": every[0],
                           "measured_s": measured.get("tpot_s"), "splits": len(splits)}
    best = min(per_k.values(), key=lambda x: x["fastest"]["predicted_s"])["fastest"]
    return {"memory_factor": factor, "pooled_disks_bound_s": round(pooled, 3), "per_k": per_k,
            "fastest": best, "share_of_the_disks_bound_at_best": round(pooled / best["predicted_s"], 3),
            "measured": {"best_over_its_bound": testbed["ratios"]["best configuration against its bound "
                                                                   "(target <= 1.2x)"],
                         "share_of_the_disks_bound": round(testbed["ratios"][
                             "ring vs plain, as a share of the most the disks allow (target >= 0.85)"], 3)}}


def main() -> int:
    out = {f"x{factor:g}": one_set(factor) for factor in SETS}
    for name, s in out.items():
        print(f"memory {name}: pooled disks' bound {s['pooled_disks_bound_s']} s", file=sys.stderr)
        for k, r in s["per_k"].items():
            t, f = r["tested"], r["fastest"]
            print(f"  {k}: tested {t['layers_per_round']} rooms {t['rooms']} predicted {t['predicted_s']} s "
                  f"(bound {t['bound_s']}, {t['predicted_over_bound']}x; measured {r['measured_s']}); fastest of "
                  f"{r['splits']} {f['layers_per_round']} rooms {f['rooms']} {f['predicted_s']} s "
                  f"({f['predicted_over_bound']}x its bound)", file=sys.stderr)
        print(f"  best over every split and k: {s['fastest']['predicted_s']} s, "
              f"{s['share_of_the_disks_bound_at_best']:.0%} of the disks' bound (measured "
              f"{s['measured']['share_of_the_disks_bound']:.0%})", file=sys.stderr)
    (RESULTS / "policy_bound.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'policy_bound.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
