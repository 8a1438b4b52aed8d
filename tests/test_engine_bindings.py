"""A node loads llama-cpp-python's ctypes bindings without its high-level API (engine/_bindings.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import synthetic_path

PROBE = """
import json, sys
def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
import numpy, msgspec, zmq
before = anon()
if sys.argv[2] == "bindings":
    from primaplug.engine import bindings_only
    assert bindings_only()
from primaplug.engine import ContextSettings, Model
with Model(sys.argv[1], [(0, 7)]) as model:
    w = model.window(0, 7, settings=ContextSettings(n_ctx=64, n_batch=16, n_ubatch=16))
    logits = w.forward([5, 6, 7, 8], 0)
import llama_cpp
print(json.dumps({"growth": anon() - before, "argmax": int(logits[-1].argmax()),
                  "high_level": "llama_cpp.llama" in sys.modules or "jinja2" in sys.modules,
                  "version": llama_cpp.__version__}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")
def test_bindings_only_run_windows_without_the_high_level_api(model_dir) -> None:
    path = str(synthetic_path(model_dir, "llama", 7, "Q8_0"))

    def probe(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", PROBE, path, mode], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    full, light = probe("full"), probe("bindings")
    assert full["high_level"] and not light["high_level"]
    assert light["argmax"] == full["argmax"] and light["version"] == full["version"]
    # jinja2, the chat formats and llama_cpp.Llama: about 4 MiB on the test machine
    assert light["growth"] < full["growth"] - 2 * 2**20, (light, full)


def test_bindings_only_changes_nothing_once_llama_cpp_is_imported() -> None:
    out = subprocess.run([sys.executable, "-c", "import llama_cpp; from primaplug.engine import bindings_only; "
                          "print(bindings_only(), hasattr(llama_cpp, 'Llama'))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
