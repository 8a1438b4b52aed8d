"""primaplug: run large GGUF models on the devices you have at home, pooled into a pipelined ring.

Importing this package has no side effects: no logging set-up, no environment reads, no native library loads.
`primaplug.Llama` (a llama_cpp.Llama backed by a ring of nodes) is imported on first use.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Llama":
        from primaplug.head.llama import Llama

        return Llama
    raise AttributeError(f"module 'primaplug' has no attribute {name!r}")
