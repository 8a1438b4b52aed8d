#!/usr/bin/env python3
"""What drafting costs on a model with recurrent layers (docs/speculative.md, "Recurrent layers: rolling back").

    .venv/bin/python benchmarks/recurrent_drafts.py [--size 400M] [--layers 24] [--positions 1500]

On a synthetic Qwen 3.5 (`primaplug synth --arch qwen35`, written once to primaplug's bench cache), 2 threads:
1. The target's side: one-token decodes (64) and four-token batches (16) with 0, 4 and 8 recurrent-state snapshots a
   sequence (llama.cpp's n_rs_seq, which a draft on such a target makes every window keep), best of 3.
2. The draft's side: a draft with recurrent layers keeps its sequence's state before drafting and goes back to it
   after a rejection (engine/speculative.py: GgufDraft); at --positions positions, the state's size, the time to keep
   it and to go back to it, against one drafted token (mean of 10).
Prints the figures and writes benchmarks/results/recurrent_drafts.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_testbed import CACHE  # noqa: E402


def _model(size: str, layers: int) -> Path:
    from primaplug.cli.synth import byte_size
    from primaplug.engine.synthetic import write_sized_model

    path = CACHE / f"qwen35-{layers}L-{size}-Q4_K_M.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        write_sized_model(path, byte_size(size), layers, arch="qwen35")
    return path


def snapshot_cost(path: Path, n_rs_seq: int) -> tuple[float, float]:
    """Seconds of a one-token decode and of a four-token batch with n_rs_seq snapshots, best of 3."""
    from llama_cpp import llama_cpp as ll

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    try:
        runs = [_decode_times(model, n_rs_seq) for _ in range(3)]
    finally:
        ll.llama_model_free(model)
    return min(r[0] for r in runs), min(r[1] for r in runs)


def _decode_times(model: object, n_rs_seq: int) -> tuple[float, float]:
    from llama_cpp import llama_cpp as ll

    from primaplug.engine import ContextSettings

    params = ContextSettings(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, n_rs_seq=n_rs_seq).params()
    ctx = ll.llama_init_from_model(model, params)
    batch = ll.llama_batch_init(64, 0, 1)
    try:
        def decode(tokens: list[int], pos0: int) -> None:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        decode(list(range(10, 42)), 0)
        t0 = time.perf_counter()
        for i in range(64):
            decode([100 + i], 32 + i)
        one = (time.perf_counter() - t0) / 64
        t0 = time.perf_counter()
        for i in range(16):
            decode([100 + j for j in range(4)], 96 + 4 * i)
        return one, (time.perf_counter() - t0) / 16
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)


def kept_state_cost(path: Path, positions: int) -> dict[str, float]:
    """A recurrent draft's kept state at `positions` positions: its size, keeping it, going back to it, a token."""
    from llama_cpp import llama_cpp as ll

    from primaplug.decoding import SamplingParams
    from primaplug.engine.speculative import GgufDraft

    draft = GgufDraft(path, n_ctx=positions + 512, n_batch=512, n_threads=2)
    try:
        context = list(np.arange(positions) % 900 + 5)
        draft.propose(np.array(context), 2, SamplingParams(temp=0.0), np.random.default_rng(0))
        assert draft._kept is not None
        data, pos = draft._kept
        t0 = time.perf_counter()
        for _ in range(10):
            draft._keep()
        keep = (time.perf_counter() - t0) / 10
        t0 = time.perf_counter()
        for _ in range(10):
            if ll.llama_state_seq_set_data(draft.llm._ctx.ctx, data, len(data), 0) != len(data):
                raise RuntimeError("llama_state_seq_set_data failed")
        back = (time.perf_counter() - t0) / 10
        draft.llm.n_tokens = pos
        t0 = time.perf_counter()
        for i in range(10):
            draft.llm.eval([5 + i])
        token = (time.perf_counter() - t0) / 10
    finally:
        draft.close()
    return {"state_bytes": len(data), "keep_s": keep, "go_back_s": back, "drafted_token_s": token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="400M")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--positions", type=int, default=1500)
    args = ap.parse_args()
    path = _model(args.size, args.layers)
    snapshots = {}
    for n in (0, 4, 8):
        one, four = snapshot_cost(path, n)
        snapshots[n] = {"one_token_s": one, "four_tokens_s": four}
        print(f"n_rs_seq {n}: one-token decode {one * 1e3:.2f} ms, four-token batch {four * 1e3:.2f} ms")
    kept = kept_state_cost(path, args.positions)
    print(f"a recurrent draft at {args.positions} positions: state {kept['state_bytes'] / 2**20:.1f} MiB, kept in "
          f"{kept['keep_s'] * 1e3:.1f} ms, gone back to in {kept['go_back_s'] * 1e3:.1f} ms; a drafted token "
          f"{kept['drafted_token_s'] * 1e3:.1f} ms")
    result = {"model": path.name, "threads": 2, "snapshots": snapshots, "positions": args.positions,
              "kept_state": kept}
    (ROOT / "benchmarks" / "results" / "recurrent_drafts.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
