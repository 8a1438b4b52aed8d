"""`primaplug engine`: what engine is installed (`status`), and building it (`build`): llama-cpp-python with
primaplug's llama.cpp patches, cached as a wheel (primaplug/engine/build.py; the first use of the engine builds
it too, primaplug/engine/ensure.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from primaplug.core import EngineError


def add_parser(sub: Any) -> None:
    from primaplug.engine import build

    engine = sub.add_parser("engine", help="show or build the patched engine (llama-cpp-python with primaplug's "
                                           "patches)")
    actions = engine.add_subparsers(dest="action", required=True)
    status = actions.add_parser("status", help="what is installed, whether it is primaplug's patched build, the "
                                               "cache (exit 1 when the engine is not ready)")
    status.set_defaults(func=main)
    make = actions.add_parser("build", help="build (or take from the cache) and install the engine into this "
                                            "Python environment",
                              description="Build llama-cpp-python with primaplug's patches for this machine, cache "
                                          "the wheel and install it. PRIMAPLUG_CMAKE_ARGS adds CMake flags (part "
                                          "of the cache key), PRIMAPLUG_CACHE moves the cache.")
    build.add_build_arguments(make)
    make.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    return status() if args.action == "status" else build_it(args)


def status() -> int:
    from primaplug.engine import build, ensure

    found = build.inspect_version(ensure.installed_version())
    if found.version is None:
        print(f"engine:   not installed ({build.DIST}); `{build.BUILD_COMMAND}` builds it, and so does its "
              "first use")
    elif found.ready:
        print(f"engine:   {build.DIST} {found.version}: primaplug's patched build of the current patches, "
              f"backend {found.gpu}")
    else:
        print(f"engine:   {found.problem}; the first use of the engine rebuilds it (or `{build.BUILD_COMMAND}`)")
    gpu = build.default_gpu()
    key = build.build_key(gpu)
    wheel = build.cached_wheel(key)
    print(f"python:   {sys.executable}")
    print(f"patches:  {len(build.patch_files())} in {build.PATCHES} (digest p{build.patch_digest()})")
    cache, origin = build.cache_location()
    print(f"cache:    {cache} ({origin})")
    print(f"this machine's {gpu} build: key {key}, " + (f"cached wheel {wheel}" if wheel else "no cached wheel"))
    return 0 if found.ready else 1


def build_it(args: argparse.Namespace) -> int:
    from primaplug.engine import build

    try:
        gpu = args.gpu or build.default_gpu()
        build.build_engine(sys.executable, gpu, force=args.force, install_it=args.install, wheel_dir=args.wheel_dir)
    except build.BuildError as e:
        raise EngineError(f"the engine build failed: {e}") from None
    return 0
