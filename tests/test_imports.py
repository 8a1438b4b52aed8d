"""The package rules of docs/ARCHITECTURE.md: dependencies point inward, one package per outside library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "primaplug"

# package -> primaplug packages it may import; every module of primaplug is in one of these (or is one of TOP)
ALLOWED = {
    "core": set(),
    "wire": {"core"},
    "transport": {"core"},
    "discovery": {"core", "wire", "transport"},
    "decoding": {"core"},
    "engine": {"core", "decoding"},
    "memory": {"core"},
    "scheduler": {"core", "decoding"},
    "profiler": {"core", "engine", "memory"},
    "device": {"core", "engine", "memory", "profiler"},
    "store": {"core", "wire", "transport", "engine", "memory"},
    "node": {"core", "wire", "transport", "engine", "memory", "profiler", "device", "store"},
    "head": {"core", "wire", "transport", "engine", "memory", "profiler", "scheduler", "device", "decoding", "store"},
    "server": {"core"},
    "tui": {"core", "wire", "scheduler", "head"},
    "cli": {"core", "wire", "transport", "engine", "memory", "profiler", "scheduler", "device", "node", "head",
            "server", "tui", "discovery", "store"},
}
TOP = {"__init__.py": {"head"}, "__main__.py": {"cli"}}  # the package's own top-level modules (Llama, main)
# outside libraries only one package may import
OWNER = {"zmq": {"transport"}, "llama_cpp": {"engine", "server"}, "highspy": {"scheduler"}, "textual": {"tui"},
         "rich": {"tui"}, "zeroconf": {"discovery"}, "ifaddr": {"discovery"},
         "huggingface_hub": {"store"}}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _check(path: Path, package: str, allowed: set[str]) -> None:
    for name in _imports(path):
        top, _, rest = name.partition(".")
        if top == "primaplug" and rest:
            dep = rest.split(".")[0]
            if dep not in (package, "__init__", "__version__"):
                assert dep in allowed, f"{path.relative_to(ROOT)} imports {name}"
        for lib, owners in OWNER.items():
            if top == lib:
                assert package in owners, f"{path.relative_to(ROOT)} imports {lib}, which only {owners} may"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_dependencies_point_inward(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        _check(path, package, ALLOWED[package])


def test_every_module_is_covered() -> None:
    """No module escapes the rules: each lies in a listed package or is one of the listed top-level ones."""
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if len(rel.parts) == 1:
            assert rel.name in TOP, f"top-level module {rel} is in no package: move it into one (ARCHITECTURE.md)"
            _check(path, "", TOP[rel.name])
        else:
            assert rel.parts[0] in ALLOWED, f"package {rel.parts[0]} has no import rule in this test"


def test_the_head_never_imports_the_node() -> None:
    assert "node" not in ALLOWED["head"] and "head" not in ALLOWED["node"]
    for path in (ROOT / "head").rglob("*.py"):
        assert not any(n.startswith("primaplug.node") for n in _imports(path)), path


def test_importing_a_node_loads_no_ui_or_solver() -> None:
    code = ("import sys, primaplug.node, primaplug.head; "
            "bad = {'textual', 'fastapi', 'highspy', 'uvicorn'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_node_command_loads_no_head_gguf_or_package_metadata() -> None:
    """What `primaplug node` imports before it serves: the command line's parser (every command's flags) and the
    node. None of these is a node's: the head's modules, gguf (with yaml) and importlib.metadata (with email) took
    5.5 MiB of an idle node's 33.9 MiB of anonymous memory, on a phone emulated at 145 MiB 3.8 points of pressure."""
    code = ("import sys\nfrom primaplug.cli import build_parser\nbuild_parser().parse_args(['node'])\n"
            "from primaplug.engine import bindings_only\nbindings_only()\n"
            "from primaplug.device import MemorySettings\nfrom primaplug.node import Node\n"
            "from primaplug.transport import ZmqTransport\nfrom primaplug.memory.prefetcher import Switches\n"
            "from llama_cpp import llama_cpp\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'gguf', 'yaml', 'email'}\n"
            "             or m.startswith(('primaplug.head', 'importlib.metadata'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_primaplug_loads_nothing_native() -> None:
    code = "import sys, primaplug; bad = {'llama_cpp', 'zmq'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_discoverys_rules_load_no_zeroconf() -> None:
    """The announcement's records and the same-cluster rules are pure: zeroconf loads with the Browser."""
    code = ("import sys, primaplug.discovery, primaplug.cli; "
            "bad = {'zeroconf', 'ifaddr', 'zmq'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_heads_logic_loads_no_engine_or_zeromq() -> None:
    """The session, the events and the cluster can be used (and unit-tested) without llama.cpp or ZeroMQ: they load
    when a model's windows or a ZeroMQ transport are made."""
    code = ("import sys, primaplug.head, primaplug.head.session, primaplug.head.events, primaplug.device; "
            "bad = {'llama_cpp', 'zmq'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
