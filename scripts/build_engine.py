#!/usr/bin/env python3
"""Build and install primaplug's engine: llama-cpp-python with the patches in patches/.

The build itself is primaplug/engine/build.py (`primaplug engine build` runs the same code once primaplug is
installed). This entry point loads that file by its path, so it runs with the standard library alone, before
any of primaplug's dependencies (or primaplug itself) are installed.

    python scripts/build_engine.py                # CPU build (Metal on Apple silicon; or $PRIMAPLUG_GPU)
    python scripts/build_engine.py --gpu cuda     # or PRIMAPLUG_GPU=cuda; also: metal, cpu
    PRIMAPLUG_CMAKE_ARGS="-DGGML_AVX512=OFF" python scripts/build_engine.py   # extra CMake flags
    python scripts/build_engine.py --no-install --wheel-dir dist/   # build and cache the wheel only
    python scripts/build_engine.py --python /opt/venv/bin/python    # build for, and install into, another env
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BUILD = Path(__file__).resolve().parent.parent / "primaplug" / "engine" / "build.py"


def load_build() -> ModuleType:
    """primaplug/engine/build.py as a module of its own (not through primaplug/__init__, nothing else loads)."""
    spec = importlib.util.spec_from_file_location("primaplug_engine_build", BUILD)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{BUILD} is missing: run this script from a primaplug checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(load_build().main())
