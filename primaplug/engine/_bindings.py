"""llama-cpp-python's ctypes bindings without its high-level API, for a process that needs only the bindings.

`import llama_cpp` runs the package's `__init__`, which loads the high-level `Llama`, its chat formats and jinja2:
5.1 MiB of anonymous memory against 1.0 MiB for the bindings alone (a one-off probe on the 2-core test machine,
a lead; tests/test_engine_bindings.py asserts 2 MiB less at least). A node
daemon never uses them, and on a small device that memory is taken from the apps people use (4 MiB is 2.8% of the
smallest emulated device in the memory testbed; the node's reported memory pressure counts from after start-up,
so it does not show there). `bindings_only()` registers the package without running its `__init__`, so that
`from llama_cpp import llama_cpp` loads the bindings and nothing else.
"""

from __future__ import annotations

import importlib.util
import sys
import types

from primaplug.engine.ensure import installed_version


def bindings_only() -> bool:
    """Make `llama_cpp`'s submodules importable without its `__init__`, in a process that has not imported it yet.

    Call it first thing in a process that never uses `llama_cpp.Llama` (a node daemon). Returns False, changing
    nothing, where llama_cpp is already imported or cannot be found (then the ordinary import applies).
    """
    if "llama_cpp" in sys.modules:
        return False
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = types.ModuleType("llama_cpp", "llama-cpp-python's ctypes bindings only (primaplug.engine._bindings)")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__spec__ = spec  # find_spec("llama_cpp") still answers (the profiler reads the library folder off it)
    package.__loader__ = spec.loader
    package.__package__ = "llama_cpp"
    package.__version__ = installed_version() or "unknown"  # type: ignore[attr-defined]
    sys.modules["llama_cpp"] = package
    return True
