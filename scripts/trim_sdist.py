#!/usr/bin/env python3
"""Write a small copy of the pinned llama-cpp-python sdist, for a machine without a network that can be sent
little (the GPU machine of scripts/gpu_check.sh takes 64 MiB in all; the sdist is 76 MB):

    python scripts/trim_sdist.py [--sdist PATH] [--out DIR/llama-cpp-python-src.tar.gz]
    PRIMAPLUG_ENGINE_SOURCE=DIR/llama-cpp-python-src.tar.gz primaplug engine build --gpu cuda

It leaves out what the engine build never reads: git history, llama.cpp's docs, vocabularies, tools, tests,
examples and benchmarks, and the ggml backends other than the CPU's, CUDA's and Metal's. The sdist is checked
against its sha256 first (the build cannot check the copy: docs/install.md, "Offline"). Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_engine import load_build  # noqa: E402  (primaplug/engine/build.py by its path: the pinned sdist)

build = load_build()
ROOT = f"llama_cpp_python-{build.VERSION}/"
VENDOR = ROOT + "vendor/llama.cpp/"
DROPPED = (ROOT + ".git/", ROOT + "docs/", ROOT + "tests/", ROOT + "examples/",
           *(VENDOR + d for d in ("docs/", "models/", "tools/", "tests/", "examples/", "benches/", "media/",
                                  ".github/", ".devops/", "gguf-py/", "pocs/", "app/", "ci/", "skills/",
                                  "vendor/cpp-httplib/")))
BACKENDS = VENDOR + "ggml/src/ggml-"
KEPT_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-metal")


def kept(name: str) -> bool:
    if name.startswith(DROPPED) or name.rstrip("/") + "/" in DROPPED:
        return False
    if name.startswith(BACKENDS):
        backend = name[len(VENDOR + "ggml/src/"):].split("/", 1)[0]
        # a backend's folder goes unless it is one of ours; files beside them (ggml-backend.cpp, ...) stay
        return "/" not in name[len(BACKENDS):] and not name.endswith("/") or backend in KEPT_BACKENDS
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = build.cache_dir() / "sdist" / build.SDIST_NAME
    ap.add_argument("--sdist", type=Path, default=cache, help=f"the pinned sdist (default {cache})")
    ap.add_argument("--out", type=Path, default=Path("llama-cpp-python-src.tar.gz"))
    a = ap.parse_args(argv)
    if not a.sdist.exists():
        print(f"trim_sdist: {a.sdist} is missing: `primaplug engine build` downloads it once", file=sys.stderr)
        return 2
    digest = build.sha256_of(a.sdist)
    if digest != build.SDIST_SHA256:
        print(f"trim_sdist: {a.sdist} has sha256 {digest}, not the pinned sdist's {build.SDIST_SHA256}",
              file=sys.stderr)
        return 2
    n = 0
    with tarfile.open(a.sdist) as src, tarfile.open(a.out, "w:gz") as dst:
        for member in src.getmembers():
            if kept(member.name):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
                n += 1
    print(f"trim_sdist: {a.out} ({a.out.stat().st_size / 1e6:.1f} MB, {n} entries of the sdist's "
          f"{a.sdist.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
