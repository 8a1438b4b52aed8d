"""Packaging hook (everything else is in pyproject.toml): the llama.cpp patch series in patches/ goes into the wheel
as primaplug/engine/patches, and into the sdist as patches/, so that an installed primaplug can build its engine
(primaplug/engine/build.py reads them there; a source checkout or an editable install reads patches/ itself)."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

PATCHES = Path(__file__).resolve().parent / "patches"


def patch_series() -> list[Path]:
    if not (PATCHES / "series").is_file():
        raise SystemExit(f"{PATCHES / 'series'} is missing: primaplug's wheel must carry the engine's patches")
    return sorted(p for p in PATCHES.iterdir() if p.is_file())


class BuildPyWithPatches(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads patches/ from the checkout
            return
        dest = Path(self.build_lib) / "primaplug" / "engine" / "patches"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for p in patch_series():
            shutil.copy2(p, dest / p.name)


class SdistWithPatches(sdist):
    def add_defaults(self) -> None:
        super().add_defaults()
        self.filelist.extend(str(p.relative_to(PATCHES.parent)) for p in patch_series())


setup(cmdclass={"build_py": BuildPyWithPatches, "sdist": SdistWithPatches})
