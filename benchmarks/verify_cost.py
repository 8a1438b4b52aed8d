#!/usr/bin/env python3
"""What one ring trip costs for 1, 3, 4 and 8 rows, on a model larger than memory (needs root).

    sudo .venv/bin/python benchmarks/verify_cost.py [--quick] [--devices paper-d1-d4/24] [--size 1800M] [--rounds 4]

Speculative decoding verifies a step's drafted tokens in one trip round the ring: on devices that stream their
layers from disk, a trip costs about the same for a few rows as for one, which is what makes it pay. The testbed
of benchmarks/memory_testbed.py (the prima.cpp paper's D1-D4 scaled down, each in its own cgroup with its own
model copy, emulated Wi-Fi links; the head, this process, uncapped and running only the output layer) and its
synthetic llama model larger than the devices' memory, windows chosen by the ring's latency model. The ring
(no draft) evaluates a prompt, then goes round with 1, 3, 4 and 8 rows from the prompt's end, in turns, each time
after rewinding to there (timed apart: the head's cost, where the devices forget in the next trip), logits for
every row as a verification needs them.
Reports the median ms per trip for each and its ratio to one row's.
Writes benchmarks/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_testbed import CACHE, RESULTS, add_testbed_args, model_file, running_windows  # noqa: E402
from benchmarks.testbed.cluster import Testbed, testbed_script  # noqa: E402
from benchmarks.testbed.devices import load_devices  # noqa: E402
from benchmarks.testbed.timing import prompt_tokens  # noqa: E402

ROWS = (1, 3, 4, 8)  # 3: a trip of primaplug's default --draft-max (2 drafted tokens and the sampled one)


def trips(llm: Any, prompt: int, repeats: int) -> tuple[dict[int, list[float]], list[float]]:
    """Seconds per trip of each row count (`repeats` each, the counts taking turns in a rotating order), and
    seconds per rewind to the prompt's end."""
    ids = prompt_tokens(prompt + max(ROWS))
    llm.eval(ids[:prompt])
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    rewinds: list[float] = []
    for r in range(repeats):
        for n in ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]:
            if llm.session.n_past > prompt:  # forget the previous trip's rows on every device
                t0 = time.perf_counter()
                llm.session.rewind(prompt)
                rewinds.append(time.perf_counter() - t0)
            llm.n_tokens = prompt
            t0 = time.perf_counter()
            llm.eval(ids[prompt:prompt + n])
            times[n].append(time.perf_counter() - t0)
    return times, rewinds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_testbed_args(ap)
    ap.add_argument("--rounds", type=int, default=4, help="k, rounds of the ring (default 4: memory_testbed's best)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--repeats", type=int, default=5, help="trips of each row count (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 trips of each row count")
    ap.add_argument("--workdir", default=str(CACHE / "testbed"), help="model copies and node logs")
    a = ap.parse_args()

    import primaplug

    repeats = 2 if a.quick else a.repeats
    devices = load_devices(a.devices)
    model = model_file(a.size, a.layers)
    caps = sum(d.cap_bytes for d in devices)
    print(f"{model.name}: {model.stat().st_size / 1e9:.2f} GB = {model.stat().st_size / caps:.2f}x the caps' "
          f"{caps / 1e9:.2f} GB", file=sys.stderr)
    with testbed_script("verify_cost"), Testbed(devices, model, Path(a.workdir)) as tb:
        _, sizes = running_windows(tb, devices, model, a.rounds)
        llm = primaplug.Llama(model, nodes=tb.addresses, route=tb.route, layers=[*sizes, 0], rounds=a.rounds,
                              n_ctx=512, n_batch=64, n_ubatch=16, n_threads=a.threads, node_threads=a.threads,
                              timeout_s=180, logits_all=True, verbose=False)
        try:
            times, rewinds = trips(llm, a.prompt, repeats)
        finally:
            llm.close()
    median = {n: statistics.median(t) for n, t in times.items()}
    results = {
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, {a.threads} threads",
        "model": {"name": model.name, "gb": model.stat().st_size / 1e9, "x_caps": model.stat().st_size / caps},
        "devices": [d.__dict__ | {"cap_bytes": d.cap_bytes} for d in devices],
        "rounds": a.rounds, "layers_per_round": sizes, "prompt": a.prompt, "repeats": repeats,
        "trip_ms_median": {str(n): round(m * 1000, 1) for n, m in median.items()},
        "ratio_to_1_row": {str(n): round(m / median[1], 3) for n, m in median.items()},
        "rewind_ms_median": round(statistics.median(rewinds) * 1000, 2),
        "trip_ms": {str(n): [round(x * 1000, 1) for x in t] for n, t in times.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verify_cost.json").write_text(json.dumps(results, indent=2) + "\n")
    for n, m in median.items():
        print(f"  {n} row(s): {m * 1000:8.1f} ms a trip (median of {repeats}), {m / median[1]:.2f}x one row's",
              file=sys.stderr)
    print(f"  rewind: {results['rewind_ms_median']} ms; wrote {RESULTS / 'verify_cost.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
