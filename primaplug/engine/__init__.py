"""The engine: the patched llama.cpp behind llama-cpp-python, run one layer window at a time.

    from primaplug.engine import Model, read_layout
    layout = read_layout(path)                   # byte ranges and shapes from the GGUF header
    with Model(path, [(0, 9), (9, 18)]) as m:    # maps the file; only these layers are ever read
        first, last = m.window(0, 9), m.window(9, 18)
        logits = last.forward(first.forward(m.tokenize("Hello"), 0), 0)

This is the only package that imports llama_cpp. `read_layout`/`ModelLayout` do not: they are imported
eagerly, while Model, Window and WindowChain load the native library on first use (PEP 562), so the planner
and the prefetcher can read layouts without it. The first import of llama_cpp in a process checks the installed
engine and builds it when it is missing or not the build of the current patches (ensure.py, build.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primaplug.engine._bindings import bindings_only
from primaplug.engine.ensure import install_import_check
from primaplug.engine.layout import SUPPORTED_ARCHS, ModelLayout, TensorSpan, read_layout

# before any module of this package imports llama_cpp: the first import checks that the installed llama-cpp-python
# is primaplug's patched build of the current patches, and builds it when it is not (ensure.py)
install_import_check()

if TYPE_CHECKING:
    from primaplug.engine.chain import WindowChain
    from primaplug.engine.model import ContextSettings, Model, Window, one_per_context

_LAZY = {
    "Model": "primaplug.engine.model",
    "Window": "primaplug.engine.model",
    "ContextSettings": "primaplug.engine.model",
    "BUSY_POLL": "primaplug.engine.model",
    "one_per_context": "primaplug.engine.model",
    "WindowChain": "primaplug.engine.chain",
    "cpu_kernels": "primaplug.engine._native",
}

__all__ = ["SUPPORTED_ARCHS", "ContextSettings", "Model", "ModelLayout", "TensorSpan", "Window", "WindowChain",
           "bindings_only", "cpu_kernels", "one_per_context", "read_layout"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'primaplug.engine' has no attribute {name!r}")
