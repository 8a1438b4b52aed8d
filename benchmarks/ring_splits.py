#!/usr/bin/env python3
"""Time hand-made layer splits on the Halda testbed's emulated devices (needs root).

    sudo .venv/bin/python benchmarks/ring_splits.py 20,8,2,2 3,4,1,0@4 [--devices paper-d1-d4-cpu/24]

Each SPLIT is the layers per round of d2, d3, d4 and the head (d1), in ring order, optionally `@K` rounds. For
each: the devices in their cgroups (as benchmarks/halda_testbed.py), the split deployed, a 16-token prompt and 4
greedy tokens timed, and the nodes' major faults per token during compute. Prints one line per split and its
memory plan per node; what docs/halda.md's table of hand-made plans came from.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_testbed import CACHE, model_file  # noqa: E402
from benchmarks.testbed.cluster import Testbed, unwind_on_sigterm  # noqa: E402
from benchmarks.testbed.devices import load_devices  # noqa: E402
from benchmarks.testbed.timing import time_greedy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("splits", nargs="+", help="layers per round, ring order, head last; `@K` for K rounds")
    ap.add_argument("--devices", default="paper-d1-d4-cpu/24", help="the first device is the head")
    ap.add_argument("--size", default="1800M")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    a = ap.parse_args()

    import primaplug
    from primaplug.head.events import Events, NodeProgress

    unwind_on_sigterm()
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)
    devices = load_devices(a.devices)
    model = model_file(a.size, 32)
    for spec in a.splits:
        sizes, _, k = spec.partition("@")
        layers = [int(x) for x in sizes.split(",")]
        events = Events()  # each node's memory plan, as it loads
        events.subscribe(lambda e: isinstance(e, NodeProgress) and "MiB" in e.message
                         and print(f"  {e.node}: {e.message}"))
        with Testbed(devices[1:], model, CACHE / "testbed", head=devices[0]) as tb:
            llm = primaplug.Llama(tb.head_model, nodes=tb.addresses, route=tb.route, layers=layers, rounds=int(k or 1),
                                  n_ctx=512, n_batch=64, n_ubatch=16, n_threads=2, node_threads=2, timeout_s=180,
                                  logits_all=True, verbose=False, events=events)
            try:
                timed = time_greedy(llm, a.prompt, a.tokens)
                faults = [round(n.status(detail=True).major_faults_per_token) for n in llm.cluster.nodes]
            finally:
                llm.close()
        print(spec, json.dumps(timed), "major faults per token:", faults, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
