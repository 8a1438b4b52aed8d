"""The patched engine on first use: before llama_cpp is first imported, check that it is primaplug's build of the
current patches, and build and install it (or install the cached wheel) when it is not.

pip never installs the engine: primaplug's dependencies leave llama-cpp-python out, since the only one PyPI has
is unpatched (and a source build). So the first import of llama_cpp in a process, wherever in primaplug it
comes from, goes through `_ImportCheck`, which reads the installed version from its metadata (importing nothing)
and judges it (build.inspect_version). Missing, unpatched, or built from other patches: it says so on stderr
and builds into the running environment, with build.py's progress, then lets the import go on. Where it cannot
build it raises EngineError naming what is missing and the command to run; it never lets an unpatched engine
load. An engine of the current patches built for any backend is accepted.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TextIO

from primaplug.core.errors import EngineError
from primaplug.engine import build
from primaplug.engine._filelock import exclusive

_lock = threading.Lock()

Builder = Callable[[str, TextIO], object]  # (gpu, where progress goes) -> anything; raises build.BuildError


def installed_version() -> str | None:
    """The llama-cpp-python installed where this process imports from, from its metadata; None when missing.

    Read off the first `.dist-info` folder of it on sys.path, as importlib.metadata finds it, without importing
    importlib.metadata: that takes 2.7 MiB of anonymous memory (with email and csv), in every node, for one line."""
    prefix = build.DIST.replace("-", "_").lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.lower().startswith(prefix) and name.endswith(".dist-info"):
                return _metadata_version(Path(entry or ".", name, "METADATA"))
    return None


def _metadata_version(metadata: Path) -> str | None:
    try:
        with metadata.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():  # the headers end at the first blank line
                    break
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _build_into_this_environment(gpu: str, out: TextIO) -> object:
    return build.build_engine(sys.executable, gpu, out=out)


def cannot_build(gpu: str) -> list[str]:
    """What stops a build into this environment here, each as a phrase; empty when nothing does (a cached wheel
    of this machine's key needs no compiler)."""
    needs_tools = build.cached_wheel(build.build_key(gpu)) is None
    reasons = [f"{tool} is missing" for tool in build.missing_tools()] if needs_tools else []
    if importlib.util.find_spec("pip") is None:
        reasons.append(f"pip is missing from this Python environment ({sys.prefix})")
    site = Path(sysconfig.get_paths()["purelib"])
    if not os.access(site, os.W_OK):
        reasons.append(f"this Python environment is read-only ({site} is not writable)")
    cache = build.cache_dir()
    existing = next((p for p in (cache, *cache.parents) if p.exists()), None)
    if existing is None or not os.access(existing, os.W_OK):
        reasons.append(f"the engine cache {cache} cannot be written (set PRIMAPLUG_CACHE to a writable folder)")
    return reasons


def _fix(gpu: str, first: str = "Install what is missing (docs/install.md lists it per platform)") -> str:
    flag = f" --gpu {gpu}" if gpu != "cpu" else ""
    return (f"{first}, then run `{build.BUILD_COMMAND}{flag}` (or `python scripts/build_engine.py{flag} --python "
            f"{sys.executable}` from a primaplug checkout)")


def _plan(gpu: str) -> str:
    engine = f"primaplug's engine ({build.DIST} {build.VERSION} with its llama.cpp patches, {gpu})"
    wheel = build.cached_wheel(build.build_key(gpu))
    if wheel is not None:
        return f"Installing {engine} from the cached wheel {wheel} into {sys.prefix}."
    return (f"Building {engine} into {sys.prefix}: this takes several minutes, once (the wheel is then cached in "
            f"{build.cache_dir() / 'engine'}, with the build log). `{build.BUILD_COMMAND} --gpu cuda` or "
            "PRIMAPLUG_GPU chooses another backend.")


def _build_lock() -> contextlib.AbstractContextManager[None]:
    """One build at a time per cache (a head and its local nodes may all start on a missing engine)."""
    return exclusive(build.cache_dir() / "engine" / ".build.lock")


def ensure_engine(version: Callable[[], str | None] = installed_version, builder: Builder | None = None,
                  out: TextIO | None = None) -> build.Installed:
    """Make sure the installed llama-cpp-python is primaplug's patched build of the current patches, building and
    installing it when it is not. Raises EngineError where it cannot (saying what is missing and what to run), or
    where llama_cpp is already loaded in this process (it cannot be swapped: the process must restart)."""
    out = out or sys.stderr
    builder = builder or _build_into_this_environment
    with _lock:
        found = build.inspect_version(version())
        if found.ready:
            return found
        loaded = sys.modules.get("llama_cpp")
        if loaded is not None:
            raise EngineError(f"{found.problem}, and llama_cpp ({getattr(loaded, '__version__', '?')}) is already "
                              f"loaded in this process. Run `{build.BUILD_COMMAND}`, then restart the process "
                              "(import primaplug before llama_cpp, and it builds the engine itself)")
        try:
            gpu = build.default_gpu()
        except build.BuildError as e:
            raise EngineError(f"{found.problem}; {e}") from None
        if reasons := cannot_build(gpu):
            raise EngineError(f"{found.problem}, and primaplug cannot build its patched engine here: "
                              f"{'; '.join(reasons)}. {_fix(gpu)}")
        print(f"primaplug: {found.problem}. {_plan(gpu)}", file=out, flush=True)
        with _build_lock():
            found = build.inspect_version(version())  # another process may have built it meanwhile
            if not found.ready:
                try:
                    builder(gpu, out)
                except build.BuildError as e:
                    raise EngineError(f"primaplug could not build its engine: {e}\n"
                                      f"{_fix(gpu, 'Fix what the message or the log shows')}") from None
        importlib.invalidate_caches()
        found = build.inspect_version(version())
        if not found.ready:
            logs = build.cache_dir() / "engine"
            raise EngineError(f"the engine was built, but {found.problem}. "
                              f"{_fix(gpu, f'See `primaplug engine status` and the build logs in {logs}')}")
        print(f"primaplug: engine {found.version} installed; going on", file=out, flush=True)
        return found


class _ImportCheck(importlib.abc.MetaPathFinder):
    """Runs ensure_engine when llama_cpp is first looked for, then gets out of the way; it stays (and raises
    again at the next import) as long as the engine is not ready, so nothing loads an unpatched llama_cpp."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "llama_cpp":
            ensure_engine()
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
        return None  # the ordinary finders import it


def install_import_check() -> None:
    """Check the engine before the first `import llama_cpp` of this process (primaplug/engine/__init__.py calls
    this). Where llama_cpp is already loaded, it must be the patched build: it cannot be replaced any more."""
    loaded = sys.modules.get("llama_cpp")
    if loaded is not None:
        found = build.inspect_version(getattr(loaded, "__version__", None))
        if not found.ready:
            raise EngineError(f"llama_cpp was imported before primaplug, and it is not primaplug's engine "
                              f"({found.problem}). Run `{build.BUILD_COMMAND}` if needed, then restart the process "
                              "and import primaplug first")
        return
    if not any(isinstance(f, _ImportCheck) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportCheck())
