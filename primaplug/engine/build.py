"""Build primaplug's engine: llama-cpp-python with the llama.cpp patches in patches/, cached as a wheel.

Downloads the pinned sdist from PyPI (once; it is cached), checks its sha256, applies the patch series in order,
builds a wheel and (unless told not to) installs it into a Python environment. The wheel is cached under a key
made of the version, the sdist hash, the patches, the build flags and (for native CPU builds) the CPU's features,
so a second run with nothing changed installs the cached wheel, or does nothing when it is already installed.

The engine's version says what it was built from: `0.3.36+primaplug.<gpu>.p<patches>.k<key>`, where <patches>
is the digest of the sdist and the patch series and <key> the cache key. primaplug accepts at run time any
engine whose <patches> is its own (a CUDA or Metal build as well as a CPU one; primaplug/engine/ensure.py).

Standard library only, and it imports nothing of primaplug: scripts/build_engine.py loads this file by its path
before any dependency is installed. The patches are found inside the installed package (the wheel carries them as
primaplug/engine/patches, setup.py) or, in a source checkout, in the repository's patches/.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

VERSION = "0.3.36"
DIST = "llama-cpp-python"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_MIN = (3, 21)  # scikit-build-core's minimum for llama-cpp-python; below it, it fetches cmake from PyPI
BACKEND_MIN = (0, 9, 2)  # llama-cpp-python's build-system requirement: scikit-build-core>=0.9.2
BUILD_COMMAND = "primaplug engine build"  # what every message that cannot go on tells people to run


def _find_patches() -> Path:
    here = Path(__file__).resolve().parent
    packaged = here / "patches"  # an installed wheel (setup.py copies patches/ there)
    return packaged if packaged.is_dir() else here.parent.parent / "patches"  # a source checkout


PATCHES = _find_patches()

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
# CMAKE_PLATFORM_NO_VERSIONED_SONAME: a library under one name only. Wheels cannot hold symlinks, so a versioned one
# was stored three times (libggml-cuda.so, .so.0, .so.0.x: a 260 MB CUDA wheel, 15 MB for the CPU's; 5 MB without)
BASE_FLAGS = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_OPENMP=OFF",
              "-DCMAKE_PLATFORM_NO_VERSIONED_SONAME=ON"]

# what tidy_wheel leaves in a wheel; part of the build key, so that wheels cached before it changed are built again
WHEEL_LAYOUT = "llama_cpp and its metadata only"

_LABEL = re.compile(
    r"^(?P<version>[^+]+)\+primaplug\."
    r"(?:(?P<gpu>[a-z]+)\.p(?P<patches>[0-9a-f]+)\.k(?P<key>[0-9a-f]+)|(?P<legacy>[0-9a-f]{16}))$"
)


class BuildError(Exception):
    """The engine could not be built; the message says why and what to do."""


def cache_location() -> tuple[Path, str]:
    """The cache folder and where it comes from: $PRIMAPLUG_CACHE, else $XDG_CACHE_HOME/primaplug, else
    ~/.cache/primaplug. The same rule as core.settings.cache_root, which this file cannot import: it runs before
    anything is installed, and the Dockerfile copies it alone (tests/test_build_engine.py keeps the two equal)."""
    if base := os.environ.get("PRIMAPLUG_CACHE"):
        return Path(base), "$PRIMAPLUG_CACHE"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "primaplug", "$XDG_CACHE_HOME/primaplug; PRIMAPLUG_CACHE moves it"
    return Path.home() / ".cache" / "primaplug", "the default; PRIMAPLUG_CACHE moves it"


def cache_dir() -> Path:
    """Where the sdist, the wheels and the build logs are kept (cache_location)."""
    return cache_location()[0]


def default_gpu() -> str:
    """$PRIMAPLUG_GPU, else Metal on Apple silicon (llama.cpp's own default there), else the CPU."""
    gpu = os.environ.get("PRIMAPLUG_GPU")
    if gpu:
        if gpu not in GPU_FLAGS:
            raise BuildError(f"PRIMAPLUG_GPU={gpu} is not one of {', '.join(sorted(GPU_FLAGS))}")
        return gpu
    return "metal" if sys.platform == "darwin" and platform.machine() == "arm64" else "cpu"


def patch_files() -> list[Path]:
    series = PATCHES / "series"
    if not series.exists():
        raise BuildError(f"{series} is missing: it lists the patches to apply, one per line (reinstall primaplug)")
    names = [ln.strip() for ln in series.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    missing = [n for n in names if not (PATCHES / n).exists()]
    if missing:
        raise BuildError(f"{series} names patches that do not exist: {', '.join(missing)}")
    return [PATCHES / n for n in names]


def _series_bytes() -> bytes:
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in patch_files())


def patch_digest() -> str:
    """What the engine's source is: the sdist and the patch series (not the flags, the GPU or the CPU)."""
    h = hashlib.sha256()
    for part in (VERSION, SDIST_SHA256):
        h.update(part.encode() + b"\0")
    h.update(_series_bytes())
    return h.hexdigest()[:12]


def _flags_line(cpuinfo: str) -> str:
    """The CPU's features in /proc/cpuinfo's text: its `flags` line (x86) or `Features` line (ARM)."""
    return next((ln for ln in cpuinfo.splitlines() if ln.startswith(("flags", "Features"))), "")


def cpu_fingerprint() -> str:
    """Features the compiler's -march=native sees; a wheel built for one CPU may crash on another."""
    text = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return hashlib.sha256(_flags_line(text).encode()).hexdigest()[:16]
    except OSError:
        pass
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        text = out.stdout
    return hashlib.sha256((text or platform.processor()).encode()).hexdigest()[:16]


def cmake_flags(gpu: str) -> list[str]:
    extra = os.environ.get("PRIMAPLUG_CMAKE_ARGS", "").split()
    native = "-DGGML_NATIVE=OFF" not in extra
    return BASE_FLAGS + GPU_FLAGS[gpu] + (NO_AMX_FLAGS if native and amx_under_hypervisor() else []) + extra


# ggml's AMX matrix kernels are built wherever -march=native says the CPU has AMX-INT8 (__AMX_INT8__). On a virtual
# machine whose CPU advertised AMX (2026-11-29, Xeon under a hypervisor), every prompt then died of SIGILL inside
# ggml_backend_amx_mul_mat, plain llama-cpp-python's included, while small AMX programs ran there: no probe tells
# such a machine apart, so a native build under a hypervisor leaves AMX out (the rest of -march=native stays).
# AMX speeds up prompts on Xeon servers, not on the home devices primaplug is for.
NO_AMX_FLAGS = ["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"]


def amx_under_hypervisor(cpuinfo: str | None = None) -> bool:
    """Whether this is an x86-64 Linux CPU that advertises AMX-INT8 under a hypervisor (see NO_AMX_FLAGS); `cpuinfo`:
    the text of /proc/cpuinfo (read when None)."""
    if cpuinfo is None:
        if sys.platform != "linux" or platform.machine() != "x86_64":
            return False
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = _flags_line(cpuinfo).split()
    return "amx_int8" in flags and "hypervisor" in flags


def local_source() -> Path | None:
    """$PRIMAPLUG_ENGINE_SOURCE: a llama-cpp-python source of the pinned version to build instead of the sdist from
    PyPI, a folder or a .tar.gz, unpatched and possibly trimmed (scripts/trim_sdist.py: 4 MB, for a machine without a
    network that can be sent little). Not checked against the sdist's sha256: the patches must still apply."""
    value = os.environ.get("PRIMAPLUG_ENGINE_SOURCE")
    return Path(value).expanduser() if value else None


def build_key(gpu: str) -> str:
    """The cache key of a build for this machine: the sdist (or a local source), the patches, the flags, the
    platform and, for native builds, the CPU."""
    h = hashlib.sha256()
    source = SDIST_SHA256 if local_source() is None else "local source"
    for part in (VERSION, source, WHEEL_LAYOUT, " ".join(cmake_flags(gpu)), platform.machine(), sys.platform):
        h.update(part.encode() + b"\0")
    h.update(_series_bytes())
    if "-DGGML_NATIVE=OFF" not in cmake_flags(gpu):
        h.update(cpu_fingerprint().encode())
    return h.hexdigest()[:16]


def engine_label(gpu: str, key: str) -> str:
    """The version the engine is built with (PEP 440 local segments; each starts with a letter, so that none is
    read as a number and normalised)."""
    return f"{VERSION}+primaplug.{gpu}.p{patch_digest()}.k{key}"


@dataclass(frozen=True)
class Installed:
    """What a llama-cpp-python version says about the engine, against the current patches."""

    version: str | None  # None: not installed
    ready: bool  # primaplug's patched build of the current patches
    gpu: str | None  # the backend it was built for, where the version says
    key: str | None  # its cache key, where the version says
    problem: str  # why it is not ready ("" when it is)


def inspect_version(version: str | None) -> Installed:
    """Judge an installed llama-cpp-python by its version alone (nothing is imported)."""
    if version is None:
        return Installed(None, False, None, None, f"{DIST} is not installed")
    m = _LABEL.match(version)
    if m is None or m["version"] != VERSION:
        return Installed(version, False, None, None,
                         f"{DIST} {version} is installed, which is not primaplug's patched build of {VERSION}")
    if m["legacy"]:  # engines built before the version carried the patches' digest: matched by their cache key
        gpu = next((g for g in GPU_FLAGS if build_key(g) == m["legacy"]), None)
        if gpu is None:
            return Installed(version, False, None, m["legacy"], f"{DIST} {version} is installed, a patched build of "
                             "other patches or flags than this primaplug's")
        return Installed(version, True, gpu, m["legacy"], "")
    if m["patches"] != patch_digest():
        return Installed(version, False, m["gpu"], m["key"], f"{DIST} {version} is installed, a patched build of "
                         f"other patches than this primaplug's (p{patch_digest()})")
    return Installed(version, True, m["gpu"], m["key"], "")


def installed_version(python: str) -> str | None:
    """The llama-cpp-python version installed in another Python environment (read from its metadata)."""
    code = "import importlib.metadata as m\ntry: print(m.version('llama-cpp-python'))\nexcept Exception: pass"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or None


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def cmake_version(cmake: str) -> tuple[int, int] | None:
    """(major, minor) that `cmake --version` prints, or None where it does not run: PyPI's cmake is a Python
    wrapper that fails outside the environment it was installed in (seen offline, inside pip's isolated build)."""
    try:
        r = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"cmake version (\d+)\.(\d+)", r.stdout)
    return (int(m[1]), int(m[2])) if r.returncode == 0 and m else None


def backend_version(python: str) -> tuple[int, ...] | None:
    """The version of scikit-build-core, llama-cpp-python's build backend, in `python`'s environment (None: not
    there). Where it is, recent enough, the build uses it and the cmake on PATH and downloads nothing; elsewhere pip
    builds in an isolated environment, which downloads both from PyPI."""
    code = "import scikit_build_core as m; print(m.__version__)"
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", r.stdout.strip())
    return tuple(int(x) for x in m.groups() if x is not None) if r.returncode == 0 and m else None


def missing_tools() -> list[str]:
    """The programs a build needs that are not on PATH or do not run (pip's own, cmake and ninja, cannot be counted
    on: PyPI's have no wheels for Termux, and its cmake runs only in its own environment)."""
    missing = []
    if shutil.which("patch") is None:
        missing.append("patch")
    cmake = shutil.which("cmake")
    version = cmake_version(cmake) if cmake else None
    if cmake is None:
        missing.append("cmake")
    elif version is None:
        missing.append(f"a cmake that runs ({cmake} does not: `cmake --version` failed; PyPI's cmake runs only in "
                       "the environment it was installed in, install your system's: apt install cmake)")
    elif version < CMAKE_MIN:
        missing.append(f"cmake {dotted(CMAKE_MIN)} or newer ({cmake} is {dotted(version)})")
    if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        missing.append("a C compiler (cc, gcc or clang)")
    if not (os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++", "clang++"))):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    return missing


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(python: str, out: TextIO) -> Path:
    dest = cache_dir() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    sdist = dest / SDIST_NAME
    if not sdist.exists():
        print(f"engine: downloading {SDIST_NAME} (50 MB) from PyPI", file=out, flush=True)
        cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", DIST,
               f"{DIST}=={VERSION}", "-d", str(dest)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not sdist.exists():
            raise BuildError(f"could not download {DIST} {VERSION} from PyPI (no network?); pip said:\n"
                             f"{(r.stdout + r.stderr).strip()}\nWithout a network, copy {SDIST_NAME} into {dest}")
    digest = sha256_of(sdist)
    if digest != SDIST_SHA256:
        sdist.unlink()
        raise BuildError(
            f"{SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}; the file was removed, run again to "
            "download it anew (if it fails again, the package on PyPI is not the one the patches were written for)"
        )
    return sdist


def apply_patches(src: Path, patches: list[Path], out: TextIO | None = None) -> None:
    """Apply the patches in order; stop at the first that does not apply, naming it and its failed hunks."""
    out = out or sys.stdout
    if shutil.which("patch") is None:
        raise BuildError("the 'patch' program is missing: install it (apt install patch / pkg install patch)")
    for p in patches:
        cmd = ["patch", "-p1", "--forward", "--batch", "--dry-run", "-i", str(p)]
        dry = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
        if dry.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to {DIST} {VERSION}:\n"
                             + describe_patch_failure(dry.stdout + dry.stderr))
        subprocess.run(cmd[:-3] + ["-s", "-i", str(p)], cwd=src, check=True)
        print(f"engine: applied {p.name}", file=out, flush=True)


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


def engine_source(python: str, out: TextIO) -> Path:
    """The source to build: $PRIMAPLUG_ENGINE_SOURCE where set (local_source), else the pinned sdist (fetch_sdist)."""
    source = local_source()
    if source is None:
        return fetch_sdist(python, out)
    if not source.exists():
        raise BuildError(f"PRIMAPLUG_ENGINE_SOURCE={source}: no such file or folder (give llama-cpp-python {VERSION}'s "
                         "source, a folder or a .tar.gz; scripts/trim_sdist.py makes a small one)")
    print(f"engine: building from the local source {source} (not checked against the sdist's sha256)", file=out,
          flush=True)
    return source


def unpack_source(source: Path, into: Path) -> Path:
    """The source tree, unpacked (a .tar.gz) or copied (a folder) into `into`, where the patches go."""
    src = into / f"llama_cpp_python-{VERSION}"
    if source.is_dir():
        shutil.copytree(source, src, symlinks=True)
        return src
    import tarfile  # here, not above: every node and head imports this module, 0.6 MiB of memory for a build's step

    with tarfile.open(source) as tar:
        # filter= is Python 3.11.4+; Debian 12's python3 is 3.11.2
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    if not src.is_dir():
        raise BuildError(f"{source} holds no llama_cpp_python-{VERSION}/ folder")
    return src


def build_wheel(python: str, sdist: Path, gpu: str, key: str, out_dir: Path, out: TextIO) -> Path:
    log_path = cache_dir() / "engine" / f"build-{key}.log"
    with tempfile.TemporaryDirectory(prefix="primaplug-engine-") as tmp:
        src = unpack_source(sdist, Path(tmp))
        apply_patches(src, patch_files(), out)
        init = src / "llama_cpp" / "__init__.py"
        init.write_text(init.read_text().replace(f'__version__ = "{VERSION}"',
                                                 f'__version__ = "{engine_label(gpu, key)}"'))

        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(cmake_flags(gpu))
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        backend = backend_version(python)
        offline = backend is not None and backend >= BACKEND_MIN
        cmd = [python, "-m", "pip", "wheel", "-v", "--no-deps", *(["--no-build-isolation"] if offline else []),
               "-w", str(out_dir), str(src)]
        print("engine: " + (f"building with this environment's scikit-build-core {dotted(backend)} "
                            "and the cmake on PATH (no download)" if offline else
                            "pip builds in an isolated environment, which downloads scikit-build-core (and cmake, "
                            f"where the one on PATH is older than {dotted(CMAKE_MIN)}) from PyPI; without a network, "
                            "install scikit-build-core into this environment first"), file=out, flush=True)
        print(f"engine: building {DIST} {VERSION} with primaplug's patches ({gpu}); this takes several minutes "
              f"(about 4 on 2 cores for the CPU). Log: {log_path}", file=out, flush=True)
        print(f"engine: CMake flags: {env['CMAKE_ARGS']}", file=out, flush=True)
        try:
            run_with_progress(cmd, env, log_path, out)
        except BuildError as e:
            if offline or "satisfies the requirement" not in log_path.read_text(errors="replace"):
                raise
            raise BuildError(f"{e}\npip could not download the build's tools (no network?): install "
                             f"scikit-build-core>={dotted(BACKEND_MIN)} into the environment of {python} (pip install "
                             f"scikit-build-core) and have cmake {dotted(CMAKE_MIN)} or newer on PATH, then run "
                             "again: the build then downloads nothing") from None
    wheels = sorted(out_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise BuildError(f"the build finished but left no wheel in {out_dir}; see {log_path}")
    return tidy_wheel(wheels[-1])


def tidy_wheel(wheel: Path, platform_tag: str | None = None) -> Path:
    """The wheel without what vendored llama.cpp's own install rules add beside the package (lib/, include/ at the
    wheel's root: a second copy of every library, 59 MB more for CUDA's, installed into site-packages/lib), and
    with platform_tag in place of the building machine's (a cross-compiled engine: scripts/rungs/cross_engine.py).
    Rewrites the wheel in place, or under its new name; returns it."""
    name, version, py, abi, tag = wheel.name[:-len(".whl")].split("-")
    dest = wheel.with_name(f"{name}-{version}-{py}-{abi}-{platform_tag or tag}.whl")
    tmp = wheel.with_name(dest.name + ".tmp")
    import zipfile  # as tarfile above

    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        info_dir = next(n for n in names if n.endswith(".dist-info/RECORD"))[:-len("RECORD")]
        kept = [i for i in src.infolist() if i.filename.startswith(("llama_cpp/", info_dir))]
        meta = src.read(info_dir + "WHEEL").decode()
        if platform_tag:
            meta = "".join(f"Tag: {py}-{abi}-{platform_tag}\n" if ln.startswith("Tag:") else ln
                           for ln in meta.splitlines(keepends=True))
        record = []
        for info in kept:
            data = meta.encode() if info.filename == info_dir + "WHEEL" else src.read(info.filename)
            if info.filename != info_dir + "RECORD":
                dst.writestr(info, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                record.append(f"{info.filename},sha256={digest},{len(data)}")
        record.append(f"{info_dir}RECORD,,")
        dst.writestr(info_dir + "RECORD", "\n".join(record) + "\n")
    wheel.unlink()
    tmp.rename(dest)
    return dest


def run_with_progress(cmd: list[str], env: dict[str, str], log_path: Path, out: TextIO) -> None:
    """Run the build, keeping its log, and show one line of progress (CMake's percentage and the time)."""
    start = time.monotonic()
    tty = out.isatty()
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
                print("\r" + msg, end="", file=out, flush=True)
            elif elapsed - last_shown >= 30:  # in CI or a log, a line every 30 s
                print(msg, file=out, flush=True)
                last_shown = elapsed
        code = proc.wait()
    if tty:
        print(file=out)
    if code != 0:
        tail = log_path.read_text().splitlines()[-40:]
        raise BuildError("the engine build failed; the end of its log:\n" + "\n".join(tail)
                         + f"\nwhole log: {log_path}")
    print(f"engine: built in {(time.monotonic() - start) / 60:.1f} min", file=out, flush=True)


def build_percent(line: str) -> int | None:
    """Progress from a build log line: ninja's "[12/83]" or make's "[ 14%]"."""
    m = re.match(r"\s*\[(\d+)/(\d+)\]", line)
    if m:
        return 100 * int(m.group(1)) // max(1, int(m.group(2)))
    m = re.match(r"\s*\[\s*(\d+)%\]", line)
    return int(m.group(1)) if m else None


def install(python: str, wheel: Path, out: TextIO) -> None:
    """Install the wheel in place of any llama-cpp-python there, then its own dependencies (numpy, jinja2,
    diskcache, typing-extensions: already there where primaplug is installed)."""
    for cmd in ([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
                [python, "-m", "pip", "install", "-q", str(wheel)]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.stdout.strip() or r.stderr.strip():
            print((r.stdout + r.stderr).strip(), file=out, flush=True)
        if r.returncode != 0:
            raise BuildError(f"pip could not install {wheel} into the environment of {python}")


def cached_wheel(key: str) -> Path | None:
    wheels = sorted((cache_dir() / "engine" / key).glob("llama_cpp_python-*.whl"))
    return wheels[-1] if wheels else None


def build_engine(python: str, gpu: str, *, force: bool = False, install_it: bool = True,
                 wheel_dir: Path | None = None, out: TextIO | None = None) -> Path | None:
    """Build (or take from the cache) the engine for `gpu` and install it into `python`'s environment.

    Returns the wheel, or None when the engine of this key was already installed (and nothing was to be copied).
    With install_it=False nothing is installed; wheel_dir gets a copy of the wheel. Progress goes to `out`
    (stdout by default)."""
    out = out or sys.stdout
    key = build_key(gpu)
    if install_it and not force and wheel_dir is None:
        found = inspect_version(installed_version(python))
        if found.ready and found.key == key:
            print(f"engine: {DIST} {found.version} is installed", file=out, flush=True)
            return None
    wheel = None if force else cached_wheel(key)
    if wheel is not None:
        print(f"engine: using the cached wheel {wheel}", file=out, flush=True)
    else:
        if missing := missing_tools():
            raise BuildError(f"the engine build needs {', '.join(missing)}, not found on PATH")
        shutil.rmtree(cache_dir() / "engine" / key, ignore_errors=True)
        wheel = build_wheel(python, engine_source(python, out), gpu, key, cache_dir() / "engine" / key, out)
    if wheel_dir is not None:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheel, wheel_dir / wheel.name)
        print(f"engine: wheel copied to {wheel_dir / wheel.name}", file=out, flush=True)
    if install_it:
        install(python, wheel, out)
        print(f"engine: {DIST} {wheel.name.split('-')[1]} installed", file=out, flush=True)
    else:
        print(f"engine: wheel {wheel} (not installed)", file=out, flush=True)
    return wheel


def add_build_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of a build, shared by scripts/build_engine.py and `primaplug engine build`."""
    ap.add_argument("--gpu", choices=sorted(GPU_FLAGS), default=None,
                    help="backend to build (default: $PRIMAPLUG_GPU, else metal on Apple silicon, else cpu)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--no-install", dest="install", action="store_false",
                    help="build and cache the wheel without installing it")
    ap.add_argument("--wheel-dir", type=Path, default=None, help="also copy the wheel into this folder")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_arguments(ap)
    ap.add_argument("--python", default=sys.executable, help="the Python environment to build with and install into")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    args = ap.parse_args(argv)
    try:
        gpu = args.gpu or default_gpu()
        if args.print_key:
            print(build_key(gpu))
            return 0
        build_engine(args.python, gpu, force=args.force, install_it=args.install, wheel_dir=args.wheel_dir)
        return 0
    except BuildError as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 1
