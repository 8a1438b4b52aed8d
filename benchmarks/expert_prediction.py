#!/usr/bin/env python3
"""How well the next layer's experts are predicted, per mixture-of-experts family, on the tests' synthetic models.

    .venv/bin/python benchmarks/expert_prediction.py [--tokens 64] [--layers 7]

For each family, a synthetic model (8 experts, 2 a token; `primaplug.engine.synthetic`) decodes greedily in one
window that reports every layer's choice and its router's input (engine/progress.py, as a streaming node sees them).
The prediction a node makes (memory/experts.py: layer l's router input through layer l+1's router, with the family's
gating, bias and groups) is compared with what layer l+1 then chose: the share of chosen experts it named, against
chance (the share a random guess of as many names). Exactness is checked too: each layer's own router on its own
input gives its choice. Writes benchmarks/results/expert_prediction.json.

What this cannot tell: a synthetic router's weights are random, so consecutive layers' choices are independent but
for the residual stream they share; trained routers agree far more from layer to layer (the pre-gated MoE papers),
and only a trained model shows how much. The figure here is the mechanism's, at its worst case.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = {"qwen3moe": "Q4_K_M", "gpt-oss": "MXFP4_MOE", "glm4moe": "Q4_K_M", "qwen35moe": "Q4_K_M",
            "qwen3next": "Q4_K_M", "llama4": "Q4_K_M", "gemma4": "Q4_K_M", "lfm2moe": "Q4_K_M",
            "minimax-m2": "Q4_K_M", "deepseek2": "Q4_K_M", "deepseek2-lite": "Q8_0", "deepseek32": "Q4_K_M",
            "glm-dsa": "Q4_K_M", "kimi-linear": "Q4_K_M"}


def measure(path: Path, tokens: int) -> dict[str, Any]:
    import numpy as np

    from primaplug.engine import ContextSettings, Model, read_layout
    from primaplug.memory.experts import load_routers

    layout = read_layout(path)
    routers = load_routers(range(layout.n_layer), layout.read_tensor, gating=layout.expert_gating,
                           groups=layout.expert_groups, groups_used=layout.expert_groups_used)
    moe = [il for il in range(layout.n_layer) if layout.expert_slices(il)]
    seen: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    settings = ContextSettings(n_ctx=tokens + 32, n_batch=32, n_ubatch=32, n_threads=1)
    with Model(path, [(0, layout.n_layer)]) as m:
        w = m.window(0, layout.n_layer, settings=settings, on_route=lambda il, c, x: seen.append((il, c, x)))
        token = [5]
        for pos in range(tokens):  # one token at a time, as decoding runs
            logits = w.forward(token, pos)
            token = [int(np.argmax(logits[-1]))]
    exact = named = chosen = 0
    by_token: dict[int, dict[int, tuple[np.ndarray, np.ndarray | None]]] = {}
    t = -1
    for il, c, x in seen:
        if il == moe[0]:
            t += 1
        by_token.setdefault(t, {})[il] = (c, x)
    for layers in by_token.values():
        for il, (c, x) in layers.items():
            exact += x is not None and set(routers[il].choose(x, layout.n_expert_used)[0]) == set(c[0])
            nxt = moe[moe.index(il) + 1] if moe.index(il) + 1 < len(moe) else None
            if nxt is None or nxt not in layers or x is None:
                continue
            guess = set(routers[nxt].choose(x, layout.n_expert_used)[0])
            actual = set(layers[nxt][0][0])
            named += len(guess & actual)
            chosen += len(actual)
    choices = sum(len(v) for v in by_token.values())
    return {"n_expert": layout.n_expert, "n_expert_used": layout.n_expert_used, "gating": layout.expert_gating,
            "groups": layout.expert_groups, "tokens": len(by_token), "own_router_exact": round(exact / choices, 4),
            "predicted_share": round(named / chosen, 4) if chosen else None,
            "chance": round(layout.n_expert_used / layout.n_expert, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=7)
    args = ap.parse_args()
    from primaplug.engine.synthetic import quantize, synthetic_spec, write_synthetic_gguf

    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, ftype in FAMILIES.items():
            f32, path = Path(tmp, f"{name}.f32.gguf"), Path(tmp, f"{name}.gguf")
            write_synthetic_gguf(f32, synthetic_spec(name, n_layer=args.layers, seed=args.layers))
            quantize(f32, path, ftype)
            r = results["families"][name] = measure(path, args.tokens)
            print(f"{name:15} predicted {r['predicted_share']:.0%} of chosen experts (chance {r['chance']:.0%}); "
                  f"own router exact {r['own_router_exact']:.0%}", flush=True)
    out = ROOT / "benchmarks" / "results" / "expert_prediction.json"
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
