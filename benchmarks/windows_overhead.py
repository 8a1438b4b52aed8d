#!/usr/bin/env python3
"""Decode time per token of a model through one window and through three chained windows, against plain
llama-cpp-python on the whole model, measured in the same run.

    .venv/bin/python benchmarks/windows_overhead.py [--model PATH] [--block 8] [--rounds 60]

The variants decode the same tokens (plain llama's greedy continuation) in short blocks taking turns: in each
round every variant decodes the next `block` tokens at the same positions, so drift on the machine hits all of
them alike, and the ratios are paired within a round (median over rounds). Writes
benchmarks/results/windows_overhead.json. The figure that matters is the ratio: the cost of splitting a model
into windows, which must stay under 3%.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from primaplug.cli.common import default_model
from primaplug.core import LayerRange, even_split, execution_order, ring_windows
from primaplug.engine import ContextSettings, Model, WindowChain, read_layout
from primaplug.engine.reference import plain_llama_forward

OUT = Path(__file__).resolve().parent / "results" / "windows_overhead.json"


def block_time(forward, tokens: list[int], pos: int) -> float:
    """Seconds per token to decode `tokens` one by one from position `pos`."""
    t0 = time.perf_counter()
    for i, tok in enumerate(tokens):
        forward([tok], pos + i)
    return (time.perf_counter() - t0) / len(tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--block", type=int, default=8, help="tokens per variant per round (default 8)")
    ap.add_argument("--rounds", type=int, default=60, help="rounds of blocks (default 60)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)
    path = Path(args.model) if args.model else default_model()
    n_layer = read_layout(path).n_layer
    settings = ContextSettings(n_ctx=1024)  # all cores, for plain llama too
    three = execution_order(ring_windows(even_split(n_layer, 3), 1, n_layer))
    one = [LayerRange(0, n_layer)]

    with Model(path, one) as model, plain_llama_forward(path, settings) as plain:
        prompt = model.tokenize("The history of distributed computing begins with")
        # the tokens to decode: plain llama's greedy continuation, fed identically to every variant
        logits, tokens = plain(prompt, 0), []
        for i in range(args.block * args.rounds):
            tokens.append(int(np.argmax(logits)))
            logits = plain([tokens[-1]], len(prompt) + i)
        chains = {"one_window": WindowChain(model, one, settings=settings),
                  "three_windows": WindowChain(model, three, settings=settings)}
        variants = {"plain_llama": plain, **{k: c.forward for k, c in chains.items()}}
        for fwd in variants.values():
            fwd(prompt, 0)  # plain llama resets itself at position 0; the chains are fresh
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds):
            block = tokens[r * args.block:(r + 1) * args.block]
            for name, fwd in variants.items():
                times[name].append(block_time(fwd, block, len(prompt) + r * args.block))
            if (r + 1) % 10 == 0:
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1000:.2f} ms" for k, v in
                                                                   times.items()), file=sys.stderr)

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)) - 1

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": path.name,
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "threads": settings.threads,
        "tokens_per_block": args.block,
        "rounds": args.rounds,
        "decode_ms_per_token_median": {k: round(v * 1000, 3) for k, v in med.items()},
        "overhead_vs_plain_paired": {k: round(paired(k, "plain_llama"), 4) for k in ("one_window", "three_windows")},
        # the cost of the split itself: three windows against one window of the same engine
        "split_overhead_three_vs_one_paired": round(paired("three_windows", "one_window"), 4),
        "windows": [str(w) for w in three],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
