"""The code passes ruff with the project's settings (pyproject.toml, [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["primaplug", "tests", "benchmarks", "scripts", "examples"]


def test_ruff_reports_nothing() -> None:
    pytest.importorskip("ruff", reason="ruff is not installed (it comes with the test extra: pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", *CHECKED], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check {' '.join(CHECKED)} failed:\n{r.stdout}{r.stderr}"
