"""The single-device baseline: plain llama-cpp-python on the whole model, in one emulated device's cgroup.

    python -m benchmarks.testbed.plain MODEL --tokens N --threads T   (prints one JSON line)

`run_capped` starts it inside a cgroup with a device's caps and returns its figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.testbed import cgroups
from benchmarks.testbed.devices import Device


def _no_repack() -> None:
    """Load weights as plain mmap-backed buffers. llama.cpp repacks Q4_K weights for AVX2 into anonymous memory,
    which needs the whole model in RAM: in a cap smaller than the model that is killed before the first token
    (measured, docs/memory.md). llama_cpp.Llama has no switch for it, so its default parameters are wrapped."""
    import llama_cpp.llama_cpp as ll

    default = ll.llama_model_default_params

    def params():  # noqa: ANN202
        p = default()
        p.use_extra_bufts = False
        return p

    ll.llama_model_default_params = params


def _measure(model: str, tokens: int, threads: int, n_ctx: int, prompt: int, repack: bool) -> dict[str, Any]:
    import llama_cpp

    from benchmarks.testbed.timing import time_greedy

    if not repack:
        _no_repack()
    t0 = time.perf_counter()
    # logits_all: llama-cpp-python 0.3 fills `scores` only then (its samplers read the context directly)
    llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, logits_all=True,
                          verbose=False)
    loaded = time.perf_counter()
    result = time_greedy(llm, prompt, tokens)
    llm.close()
    return {"load_s": round(loaded - t0, 3), **result}


def run_capped(device: Device, model: Path, workdir: Path, *, tokens: int, threads: int, n_ctx: int,
               prompt: int, repack: bool = False, timeout_s: float = 3600) -> dict[str, Any]:
    """Plain llama-cpp-python in a cgroup with `device`'s memory and disk caps, on its own model copy."""
    from benchmarks.testbed.cluster import copy_model

    copy = copy_model(model, workdir / device.name / model.name)
    group = cgroups.Cgroup("plain-" + device.name, cgroups.Caps(device.cap_bytes, device.read_bps, device.cpus),
                           cgroups.block_device(copy)).create()
    try:
        cgroups.drop_caches()
        cmd = [sys.executable, "-m", "benchmarks.testbed.plain", str(copy), "--tokens", str(tokens), "--threads",
               str(threads), "--n-ctx", str(n_ctx), "--prompt", str(prompt)] + (["--repack"] if repack else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=group.preexec)
        if done.returncode == -9:
            return {"killed": True, "peak_memory_bytes": group.memory_peak_bytes()}  # out of memory in the cap
        if done.returncode != 0:
            raise RuntimeError(f"plain llama-cpp-python failed (exit {done.returncode}): {done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["peak_memory_bytes"] = group.memory_peak_bytes()
        return result
    finally:
        group.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repack", action="store_true", help="let llama.cpp repack weights (its default)")
    a = ap.parse_args()
    print(json.dumps(_measure(a.model, a.tokens, a.threads, a.n_ctx, a.prompt, a.repack)))


if __name__ == "__main__":
    main()
