"""The engine build: cache keys, patch failures that name the patch and hunk, no rebuild when nothing changed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_engine", ROOT / "scripts" / "build_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_engine_is_the_current_build(build) -> None:
    """What `make test` installed is the build of the current patches, so running it again rebuilds nothing."""
    key = build.build_key("cpu")
    assert build.installed_version(sys.executable) == f"{build.VERSION}+primaplug.{key}"
    assert build.main(["--gpu", "cpu"]) == 0  # finds it installed and returns at once


def test_key_follows_flags_and_patches(build, monkeypatch, tmp_path) -> None:
    cpu, cuda = build.build_key("cpu"), build.build_key("cuda")
    assert cpu != cuda and cpu == build.build_key("cpu")
    monkeypatch.setenv("PRIMAPLUG_CMAKE_ARGS", "-DGGML_AVX512=OFF")
    assert build.build_key("cpu") != cpu
    monkeypatch.delenv("PRIMAPLUG_CMAKE_ARGS")
    patches = tmp_path / "patches"
    patches.mkdir()
    for p in build.patch_files():
        (patches / p.name).write_bytes(p.read_bytes())
    (patches / "series").write_text((build.PATCHES / "series").read_text())
    monkeypatch.setattr(build, "PATCHES", patches)
    assert build.build_key("cpu") == cpu
    first = build.patch_files()[0]
    first.write_text(first.read_text() + "\n")
    assert build.build_key("cpu") != cpu


def test_patch_that_no_longer_applies_names_patch_and_hunk(build, tmp_path) -> None:
    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    (src / "lib" / "a.c").write_text("int one = 1;\nint two = 2;\nint three = 3;\n")
    patch = tmp_path / "0001-change-two.patch"
    patch.write_text(
        "--- a/lib/a.c\n+++ b/lib/a.c\n@@ -1,3 +1,3 @@\n"
        " int one = 1;\n-int two = 22;\n+int two = 20;\n int three = 3;\n"
    )
    with pytest.raises(build.BuildError) as e:
        build.apply_patches(src, [patch])
    msg = str(e.value)
    assert "0001-change-two.patch" in msg and "lib/a.c" in msg and "hunk #1" in msg
    assert (src / "lib" / "a.c").read_text().startswith("int one = 1;\nint two = 2;")  # nothing half-applied


def test_progress_parsing(build) -> None:
    assert build.build_percent("  [41/83] /usr/bin/g++ -c x.cpp") == 49
    assert build.build_percent("[ 14%] Building CXX object") == 14
    assert build.build_percent("-- Configuring done") is None
