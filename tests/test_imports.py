"""The package rules of docs/ARCHITECTURE.md: dependencies point inward, one package per outside library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "primaplug"

# package -> primaplug packages it may import
ALLOWED = {
    "core": set(),
    "wire": {"core"},
    "transport": {"core"},
    "engine": {"core"},
    "memory": {"core"},
    "decoding": {"core"},
    "scheduler": {"core"},
    "profiler": {"core", "engine", "memory"},
    "node": {"core", "wire", "transport", "engine", "memory", "profiler"},
    "coordinator": {"core", "wire", "transport", "scheduler"},
    "server": {"core"},
}
# outside libraries only one package may import (the composition modules at the top level excepted)
OWNER = {"zmq": {"transport"}, "llama_cpp": {"engine", "server"}, "highspy": {"scheduler"}}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_dependencies_point_inward(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        for name in _imports(path):
            top, _, rest = name.partition(".")
            if top == "primaplug" and rest:
                dep = rest.split(".")[0]
                if dep != package and dep != "__init__":
                    assert dep in ALLOWED[package] or dep == "__version__", f"{path.name} imports {name}"
            for lib, owners in OWNER.items():
                if top == lib:
                    assert package in owners, f"{path.relative_to(ROOT)} imports {lib}, which only {owners} may"


def test_importing_a_node_loads_no_ui_or_solver() -> None:
    code = ("import sys, primaplug.node, primaplug.coordinator; "
            "bad = {'textual', 'fastapi', 'highspy', 'uvicorn'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_primaplug_loads_nothing_native() -> None:
    code = "import sys, primaplug; bad = {'llama_cpp', 'zmq'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
