#!/usr/bin/env python3
"""Build and install primaplug's engine: llama-cpp-python with the patches in patches/.

Downloads the pinned sdist from PyPI (once; it is cached), checks its sha256, applies patches/series in order,
builds a wheel and installs it into the given Python environment. The wheel is cached under a key made of
the version, the sdist hash, the patches, the build flags and (for native CPU builds) the CPU's features, so
a second run with nothing changed installs the cached wheel, or does nothing when it is already installed.

Standard library only: this runs before any of the project's dependencies are installed.

    python scripts/build_engine.py                # CPU build (the default)
    python scripts/build_engine.py --gpu cuda     # or PRIMAPLUG_GPU=cuda; also: metal
    PRIMAPLUG_CMAKE_ARGS="-DGGML_AVX512=OFF" python scripts/build_engine.py   # extra CMake flags
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"

GPU_FLAGS = {
    "cpu": ["-DGGML_CUDA=OFF", "-DGGML_METAL=OFF"],
    "cuda": ["-DGGML_CUDA=ON"],
    "metal": ["-DGGML_METAL=ON"],
}
# mtmd (multimodal) and llama.cpp's common library are not used by primaplug; leaving them out saves
# about half of the build time.
# OpenMP off: ggml then uses its own thread pool, which primaplug shares between a process's windows and lets
# sleep between calls. libgomp's workers spin after every call instead, which on a device running several
# processes (or the apps people use) takes the cores the next computation needs: on 2 cores a one-node ring
# decoded at 1.7x plain llama's time per token with OpenMP and within noise of it without.
BASE_FLAGS = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_OPENMP=OFF"]


class BuildError(Exception):
    """The engine could not be built; the message says why and what to do."""


def cache_dir() -> Path:
    base = os.environ.get("PRIMAPLUG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "primaplug"
    )
    return Path(base)


def patch_files() -> list[Path]:
    series = PATCHES / "series"
    if not series.exists():
        raise BuildError(f"{series} is missing: it lists the patches to apply, one per line")
    names = [ln.strip() for ln in series.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    missing = [n for n in names if not (PATCHES / n).exists()]
    if missing:
        raise BuildError(f"patches/series names patches that do not exist: {', '.join(missing)}")
    return [PATCHES / n for n in names]


def cpu_fingerprint() -> str:
    """Features the compiler's -march=native sees; a wheel built for one CPU may crash on another."""
    text = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
        return hashlib.sha256(flags.encode()).hexdigest()[:16]
    except OSError:
        pass
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        text = out.stdout
    return hashlib.sha256((text or platform.processor()).encode()).hexdigest()[:16]


def cmake_flags(gpu: str) -> list[str]:
    extra = os.environ.get("PRIMAPLUG_CMAKE_ARGS", "").split()
    return BASE_FLAGS + GPU_FLAGS[gpu] + extra


def build_key(gpu: str) -> str:
    h = hashlib.sha256()
    for part in (VERSION, SDIST_SHA256, " ".join(cmake_flags(gpu)), platform.machine(), sys.platform):
        h.update(part.encode() + b"\0")
    for p in patch_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    if "-DGGML_NATIVE=OFF" not in cmake_flags(gpu):
        h.update(cpu_fingerprint().encode())
    return h.hexdigest()[:16]


def installed_version(python: str) -> str | None:
    code = "import importlib.metadata as m\ntry: print(m.version('llama-cpp-python'))\nexcept Exception: pass"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(python: str) -> Path:
    dest = cache_dir() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    sdist = dest / SDIST_NAME
    if not sdist.exists():
        print(f"engine: downloading {SDIST_NAME} from PyPI", flush=True)
        cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={VERSION}", "-d", str(dest)]
        if subprocess.run(cmd).returncode != 0 or not sdist.exists():
            raise BuildError(f"could not download llama-cpp-python {VERSION} from PyPI (see pip's message above)")
    digest = sha256_of(sdist)
    if digest != SDIST_SHA256:
        sdist.unlink()
        raise BuildError(
            f"{SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}; the file was removed, run again to "
            "download it anew (if it fails again, the package on PyPI is not the one the patches were written for)"
        )
    return sdist


def apply_patches(src: Path, patches: list[Path]) -> None:
    """Apply the patches in order; stop at the first that does not apply, naming it and its failed hunks."""
    if shutil.which("patch") is None:
        raise BuildError("the 'patch' program is missing: install it (apt install patch / pkg install patch)")
    for p in patches:
        cmd = ["patch", "-p1", "--forward", "--batch", "--dry-run", "-i", str(p)]
        dry = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
        if dry.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to llama-cpp-python {VERSION}:\n"
                             + describe_patch_failure(dry.stdout + dry.stderr))
        subprocess.run(cmd[:-3] + ["-s", "-i", str(p)], cwd=src, check=True)
        print(f"engine: applied {p.name}", flush=True)


def describe_patch_failure(output: str) -> str:
    """Name the file and hunk of each failure in patch(1)'s output."""
    lines, current = [], "?"
    for ln in output.splitlines():
        m = re.match(r"(?:patching|checking) file (.+)", ln)
        if m:
            current = m.group(1)
        m = re.match(r"Hunk #(\d+) FAILED at (\d+)", ln)
        if m:
            lines.append(f"  {current}: hunk #{m.group(1)} failed (expected near line {m.group(2)})")
        elif "can't find file" in ln or "No file to patch" in ln or "Reversed" in ln:
            lines.append(f"  {ln.strip()}")
    return "\n".join(lines or [output.strip()])


def build_wheel(python: str, sdist: Path, gpu: str, key: str, out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="primaplug-engine-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{VERSION}"
        apply_patches(src, patch_files())
        init = src / "llama_cpp" / "__init__.py"
        init.write_text(init.read_text().replace(f'__version__ = "{VERSION}"',
                                                 f'__version__ = "{VERSION}+primaplug.{key}"'))

        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(cmake_flags(gpu))
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        log_path = cache_dir() / "engine" / f"build-{key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        cmd = [python, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out), str(src)]
        print(f"engine: building llama-cpp-python {VERSION} ({gpu}); this takes several minutes. Log: {log_path}",
              flush=True)
        run_with_progress(cmd, env, log_path)
    wheels = sorted(out.glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise BuildError(f"the build finished but left no wheel in {out}; see {log_path}")
    return wheels[-1]


def run_with_progress(cmd: list[str], env: dict[str, str], log_path: Path) -> None:
    """Run the build, keeping its log, and show one line of progress (CMake's percentage and the time)."""
    start = time.monotonic()
    tty = sys.stdout.isatty()
    last_shown = -1.0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            percent = build_percent(line)
            if percent is None:
                continue
            elapsed = time.monotonic() - start
            msg = f"engine: build {percent:3d}%  {elapsed / 60:4.1f} min"
            if tty:
                print("\r" + msg, end="", flush=True)
            elif elapsed - last_shown >= 30:  # in CI, a line every 30 s
                print(msg, flush=True)
                last_shown = elapsed
        code = proc.wait()
    if tty:
        print()
    if code != 0:
        tail = log_path.read_text().splitlines()[-40:]
        raise BuildError("the engine build failed; the end of its log:\n" + "\n".join(tail)
                         + f"\nwhole log: {log_path}")
    print(f"engine: built in {(time.monotonic() - start) / 60:.1f} min", flush=True)


def build_percent(line: str) -> int | None:
    """Progress from a build log line: ninja's "[12/83]" or make's "[ 14%]"."""
    m = re.match(r"\s*\[(\d+)/(\d+)\]", line)
    if m:
        return 100 * int(m.group(1)) // max(1, int(m.group(2)))
    m = re.match(r"\s*\[\s*(\d+)%\]", line)
    return int(m.group(1)) if m else None


def install(python: str, wheel: Path) -> None:
    cmd = [python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)]
    if subprocess.run(cmd).returncode != 0:
        raise BuildError(f"pip could not install {wheel}")
    # llama-cpp-python's own dependencies (numpy, jinja2, diskcache, typing-extensions)
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", choices=sorted(GPU_FLAGS), default=os.environ.get("PRIMAPLUG_GPU", "cpu"),
                    help="backend to build (default: $PRIMAPLUG_GPU or cpu)")
    ap.add_argument("--python", default=sys.executable, help="the Python environment to install into")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    args = ap.parse_args(argv)
    try:
        key = build_key(args.gpu)
        if args.print_key:
            print(key)
            return 0
        want = f"{VERSION}+primaplug.{key}"
        if not args.force and installed_version(args.python) == want:
            print(f"engine: llama-cpp-python {want} is installed", flush=True)
            return 0
        wheel_dir = cache_dir() / "engine" / key
        cached = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
        if cached and not args.force:
            print(f"engine: installing cached wheel {cached[-1].name}", flush=True)
            wheel = cached[-1]
        else:
            shutil.rmtree(wheel_dir, ignore_errors=True)
            wheel = build_wheel(args.python, fetch_sdist(args.python), args.gpu, key, wheel_dir)
        install(args.python, wheel)
        print(f"engine: llama-cpp-python {want} installed", flush=True)
        return 0
    except BuildError as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
