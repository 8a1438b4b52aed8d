"""Installing primaplug: scripts/install.sh on a Termux-like prefix, a Mac and Linux (their tools replaced by fakes
that record how they were called), and the engine's first-use check (primaplug/engine/ensure.py), which builds a
missing, unpatched or outdated engine, or says why it cannot, and never lets an unpatched llama_cpp load."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from primaplug.core.errors import EngineError
from primaplug.engine import build, ensure

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install.sh"
TERMUX_PACKAGES = ("python python-pip python-numpy python-psutil clang cmake ninja make patch pkg-config binutils "
                   "libzmq libandroid-spawn")

# every fake appends "<its path> <args>" to $FAKE_LOG
_LOG = 'printf "%s" "$0" >> "$FAKE_LOG"; for a; do printf " %s" "$a" >> "$FAKE_LOG"; done; echo >> "$FAKE_LOG"\n'
FAKES = {
    # answers install.sh's one question ("3.13 android"), and makes a venv holding a python like itself
    "python": _LOG + textwrap.dedent("""\
        if [ "$1" = -c ]; then echo "$FAKE_PYTHON_INFO"; exit 0; fi
        if [ "$1" = -m ] && [ "$2" = venv ]; then
            for last; do :; done
            mkdir -p "$last/bin" && cp "$0" "$last/bin/python"
        fi
        """),
    "uname": _LOG + 'case $1 in -s) echo "$FAKE_UNAME_S" ;; -m) echo "$FAKE_UNAME_M" ;; esac\n',
    "xcode-select": _LOG + 'echo /Library/Developer/CommandLineTools\n',
    "id": 'echo "${FAKE_UID:-1000}"\n',
    "brew": _LOG + '[ "$1" = --prefix ] && echo /opt/homebrew; exit 0\n',
}


def _fake(folder: Path, name: str, body: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + (body if body is not None else FAKES.get(name, _LOG)))
    path.chmod(0o755)


class Machine:
    """A fake machine: a PATH of fakes plus the few real tools install.sh itself uses, a HOME, an environment."""

    def __init__(self, tmp: Path, bin_dir: Path, home: Path, **env: str) -> None:
        self.tmp, self.bin, self.home = tmp, bin_dir, home
        system = tmp / "system"
        system.mkdir(parents=True)
        for tool in ("sh", "sed", "dirname", "mkdir", "cp"):
            (system / tool).symlink_to(_which(tool))
        home.mkdir(parents=True, exist_ok=True)
        self.log = tmp / "calls.log"
        self.env = {"PATH": f"{bin_dir}:{system}", "HOME": str(home), "FAKE_LOG": str(self.log), **env}

    def fake(self, *names: str) -> Machine:
        for name in names:
            _fake(self.bin, name)
        return self

    def install(self, *args: str) -> subprocess.CompletedProcess[str]:
        self.log.write_text("")
        return subprocess.run(["/bin/sh", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=60)

    def install_ok(self, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        """install(), which must succeed, and the calls it made."""
        r = self.install(*args)
        assert r.returncode == 0, r.stderr
        return r, self.calls()

    def calls(self) -> list[str]:
        """The recorded calls, each as "<name> <args>" (the venv's python by its full path)."""
        out = []
        for line in self.log.read_text().splitlines():
            path, _, args = line.partition(" ")
            name = path if path.startswith(str(self.tmp / "venv")) else Path(path).name
            out.append(f"{name} {args}".strip())
        return out


def _which(tool: str) -> str:
    for folder in ("/bin", "/usr/bin"):
        if os.access(f"{folder}/{tool}", os.X_OK):
            return f"{folder}/{tool}"
    raise AssertionError(f"{tool} is not on this machine")


def termux(tmp_path: Path, python_info: str = "3.13 android", **env: str) -> Machine:
    """Laid out as Termux is: $PREFIX=.../data/data/com.termux/files/usr, its bin/ on PATH, HOME beside it."""
    prefix = tmp_path / "data" / "data" / "com.termux" / "files" / "usr"
    env.setdefault("FAKE_UNAME_M", "aarch64")
    machine = Machine(tmp_path, prefix / "bin", prefix.parent / "home", PREFIX=str(prefix), TERMUX_VERSION="0.118.1",
                      FAKE_PYTHON_INFO=python_info, **env)
    _fake(prefix / "bin", "python3", FAKES["python"])
    return machine.fake("pkg", "python", "uname")


def macos(tmp_path: Path, arch: str = "arm64") -> Machine:
    machine = Machine(tmp_path, tmp_path / "bin", tmp_path / "Users" / "me", FAKE_UNAME_S="Darwin",
                      FAKE_UNAME_M=arch, FAKE_PYTHON_INFO="3.13 darwin")
    _fake(tmp_path / "bin", "python3.13", FAKES["python"])
    return machine.fake("uname", "xcode-select", "cmake", "brew")


def linux(tmp_path: Path, *tools: str) -> Machine:
    machine = Machine(tmp_path, tmp_path / "bin", tmp_path / "home" / "me", FAKE_UNAME_S="Linux",
                      FAKE_UNAME_M="x86_64", FAKE_PYTHON_INFO="3.12 linux", CUDA_HOME=str(tmp_path / "no-cuda"))
    _fake(tmp_path / "bin", "python3", FAKES["python"])
    return machine.fake("uname", "id", *tools)


def test_termux_dry_run_prints_and_runs_nothing(tmp_path) -> None:
    m = termux(tmp_path)
    venv = tmp_path / "venv"
    r = m.install("--dry-run", "--venv", str(venv))
    assert r.returncode == 0, r.stderr
    assert "platform: termux (aarch64), dry run" in r.stdout
    assert f"+ pkg install -y {TERMUX_PACKAGES}" in r.stdout
    assert f"+ python -m venv --system-site-packages --without-pip {venv}" in r.stdout
    assert f"+ {venv}/bin/python -m pip install -e '{ROOT}[dashboard]'" in r.stdout
    assert f"+ {venv}/bin/python -m primaplug engine build --gpu cpu" in r.stdout
    assert f"{m.home}/.cache/primaplug" in r.stdout
    assert "PRIMAPLUG_CMAKE_ARGS" not in r.stdout
    # only the read-only questions were asked: the Python's version and the machine
    assert {c.split()[0] for c in m.calls()} <= {"python", "uname"}
    assert not venv.exists()


def test_termux_install_with_fakes(tmp_path) -> None:
    m = termux(tmp_path)
    venv = tmp_path / "venv"
    r, calls = m.install_ok("--venv", str(venv))
    assert f"pkg install -y {TERMUX_PACKAGES}" in calls
    assert f"python -m venv --system-site-packages --without-pip {venv}" in calls  # pkg's numpy and psutil
    assert f"{venv}/bin/python -m pip install -e {ROOT}[dashboard]" in calls
    assert calls[-1] == f"{venv}/bin/python -m primaplug engine build --gpu cpu"
    assert calls.index(f"pkg install -y {TERMUX_PACKAGES}") < calls.index(
        f"python -m venv --system-site-packages --without-pip {venv}")
    assert "platform: termux (aarch64)" in r.stdout
    assert "highspy (Halda's solver) is left out on Termux" in r.stdout and "warning" not in r.stdout
    assert f"The engine cache is {m.home}/.cache/primaplug" in r.stdout


def test_termux_cache_and_extras_follow_the_environment(tmp_path) -> None:
    m = termux(tmp_path, PRIMAPLUG_CACHE=str(tmp_path / "sd" / "cache"))
    r, calls = m.install_ok("--venv", str(tmp_path / "venv"), "--extras", "", "--no-system-packages")
    assert not [c for c in calls if c.startswith("pkg")]
    assert f"{tmp_path}/venv/bin/python -m pip install -e {ROOT}" in calls
    assert f"The engine cache is {tmp_path}/sd/cache" in r.stdout


def test_termux_python_too_old_or_not_android(tmp_path) -> None:
    r = termux(tmp_path / "a", python_info="3.10 linux").install("--venv", str(tmp_path / "venv"))
    assert r.returncode == 1 and "older than 3.11" in r.stderr and "pkg upgrade python" in r.stderr
    r = termux(tmp_path / "b", python_info="3.12 linux").install("--dry-run", "--venv", str(tmp_path / "venv"))
    assert r.returncode == 0 and "warning: this Termux Python reports sys.platform 'linux'" in r.stdout


def test_macos_on_apple_silicon_builds_metal(tmp_path) -> None:
    m = macos(tmp_path)
    venv = tmp_path / "venv"
    r, calls = m.install_ok("--venv", str(venv))
    assert "xcode-select -p" in calls and not [c for c in calls if c.startswith("brew")]
    assert f"python3.13 -m venv {venv}" in calls
    assert calls[-1] == f"{venv}/bin/python -m primaplug engine build --gpu metal"
    assert f"{m.home}/.cache/primaplug" in r.stdout


def test_macos_without_cmake_uses_homebrew_and_intel_builds_cpu(tmp_path) -> None:
    m = macos(tmp_path, arch="x86_64")
    (m.bin / "cmake").unlink()
    r = m.install("--venv", str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    assert "brew install cmake" in m.calls()
    assert m.calls()[-1].endswith("engine build --gpu cpu")


def test_linux_builds_cuda_where_nvcc_is(tmp_path) -> None:
    m = linux(tmp_path / "gpu", "cc", "c++", "cmake", "make", "patch", "nvcc")
    r = m.install("--venv", str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    assert m.calls()[-1].endswith("engine build --gpu cuda")
    assert "PRIMAPLUG_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=native" in r.stdout
    m.env["PRIMAPLUG_CMAKE_ARGS"] = "-DCMAKE_CUDA_ARCHITECTURES=90"  # the caller's flags win
    assert "PRIMAPLUG_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90" in m.install("--dry-run").stdout

    m = linux(tmp_path / "cpu", "cc", "c++", "cmake", "make", "patch")
    r = m.install("--venv", str(tmp_path / "venv2"))
    assert r.returncode == 0, r.stderr
    assert f"python3 -m venv {tmp_path}/venv2" in m.calls()  # no system site-packages off Termux
    assert m.calls()[-1].endswith("engine build --gpu cpu") and "PRIMAPLUG_CMAKE_ARGS" not in r.stdout


def test_linux_installs_what_is_missing_or_says_what_to_run(tmp_path) -> None:
    m = linux(tmp_path, "cc", "c++", "make", "apt-get", "sudo")
    r = m.install("--venv", str(tmp_path / "venv"))
    assert r.returncode == 0, r.stderr
    assert "sudo apt-get install -y build-essential cmake patch python3-venv" in m.calls()
    r = m.install("--venv", str(tmp_path / "venv"), "--no-system-packages")
    assert r.returncode == 1 and "missing: cmake patch" in r.stderr and "apt-get install" in r.stderr


def test_bad_options_are_refused(tmp_path) -> None:
    m = linux(tmp_path)
    assert "choose cpu, cuda or metal" in m.install("--gpu", "vulkan").stderr
    assert "unknown option --fast" in m.install("--fast").stderr
    r = m.install("--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout


# --- the engine on first use ---------------------------------------------------------------------------------------

CURRENT = build.engine_label("cpu", build.build_key("cpu"))
OTHER_PATCHES = f"{build.VERSION}+primaplug.cpu.p000000000000.k0123456789abcdef"


class FakeEngine:
    """The installed llama-cpp-python's version, and a build that installs `after` (or raises)."""

    def __init__(self, before: str | None, after: str | None = CURRENT, error: str | None = None) -> None:
        self.version, self.after, self.error, self.builds = before, after, error, []

    def read(self) -> str | None:
        return self.version

    def build(self, gpu: str, out) -> None:
        self.builds.append(gpu)
        if self.error:
            raise build.BuildError(self.error)
        self.version = self.after


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not loaded llama_cpp, an empty engine cache, the default backend."""
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PRIMAPLUG_GPU", raising=False)
    if build.missing_tools():
        pytest.skip(f"this machine lacks {build.missing_tools()}, which the engine build needs")


def test_a_current_engine_is_used_as_it_is(fresh) -> None:
    engine, out = FakeEngine(CURRENT), io.StringIO()
    assert ensure.ensure_engine(engine.read, engine.build, out).ready
    assert engine.builds == [] and out.getvalue() == ""
    cuda = FakeEngine(build.engine_label("cuda", "0123456789abcdef"))  # another backend of the same patches
    assert ensure.ensure_engine(cuda.read, cuda.build, out).gpu == "cuda" and cuda.builds == []


@pytest.mark.parametrize(("before", "problem"), [
    (None, "llama-cpp-python is not installed"),
    (build.VERSION, "not primaplug's patched build"),
    ("0.3.16", "not primaplug's patched build"),
    (OTHER_PATCHES, "other patches than this primaplug's"),
])
def test_a_missing_unpatched_or_outdated_engine_is_built_first(fresh, tmp_path, before, problem) -> None:
    engine, out = FakeEngine(before), io.StringIO()
    found = ensure.ensure_engine(engine.read, engine.build, out)
    assert found.ready and found.version == CURRENT and engine.builds == ["cpu"]
    said = out.getvalue()
    assert problem in said and "several minutes" in said and str(tmp_path / "cache" / "engine") in said
    assert f"engine {CURRENT} installed; going on" in said


def test_no_silent_fallback_when_the_build_fails_or_installs_no_engine(fresh) -> None:
    engine = FakeEngine(build.VERSION, error="the engine build failed; whole log: /x/build.log")
    with pytest.raises(EngineError, match="(?s)could not build its engine.*whole log.*`primaplug engine build`"):
        ensure.ensure_engine(engine.read, engine.build, io.StringIO())
    engine = FakeEngine(build.VERSION, after=build.VERSION)  # "built", still PyPI's
    with pytest.raises(EngineError, match="the engine was built, but .* not primaplug's patched build"):
        ensure.ensure_engine(engine.read, engine.build, io.StringIO())


def test_where_it_cannot_build_it_says_what_is_missing(fresh, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    engine = FakeEngine(build.VERSION)
    with pytest.raises(EngineError) as e:
        ensure.ensure_engine(engine.read, engine.build, io.StringIO())
    msg = str(e.value)
    assert "not primaplug's patched build" in msg and "patch is missing; cmake is missing" in msg
    assert "`primaplug engine build`" in msg and engine.builds == []


def test_a_read_only_environment_is_not_built_into(fresh, monkeypatch, tmp_path) -> None:
    """Where site-packages cannot be written (a system Python, a read-only image), nothing is built."""
    paths = {**ensure.sysconfig.get_paths(), "purelib": str(tmp_path / "gone" / "site-packages")}
    monkeypatch.setattr(ensure.sysconfig, "get_paths", lambda: paths)
    engine = FakeEngine(None)
    with pytest.raises(EngineError, match="not installed, and .* read-only .*`primaplug engine build`"):
        ensure.ensure_engine(engine.read, engine.build, io.StringIO())
    assert engine.builds == []


def test_a_loaded_unpatched_llama_cpp_needs_a_restart(fresh, monkeypatch) -> None:
    loaded = type(sys)("llama_cpp")
    loaded.__version__ = build.VERSION
    monkeypatch.setitem(sys.modules, "llama_cpp", loaded)
    engine = FakeEngine(None)
    with pytest.raises(EngineError, match="already loaded in this process.*restart the process"):
        ensure.ensure_engine(engine.read, engine.build, io.StringIO())
    assert engine.builds == []
    with pytest.raises(EngineError, match="imported before primaplug.*restart the process"):
        ensure.install_import_check()
    loaded.__version__ = CURRENT
    ensure.install_import_check()  # the patched engine, loaded first: nothing to do


def _fake_engine_metadata(site: Path, version: str) -> None:
    info = site / "llama_cpp_python-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n")


def _python(code: str, site: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter whose installed llama-cpp-python reads as `site` says, with no build tools
    on PATH and an empty engine cache (so a build cannot start)."""
    (tmp_path / "empty").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "PATH": str(tmp_path / "empty"),
           "PRIMAPLUG_CACHE": str(tmp_path / "cache")}
    env.pop("PRIMAPLUG_GPU", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_first_import_of_llama_cpp_is_checked(tmp_path) -> None:
    """The real hook, in a fresh process: an unpatched engine never loads, however often it is imported, through
    `import llama_cpp` or the node's bindings-only import; the CLI turns it into one line; a current one loads."""
    unpatched = tmp_path / "unpatched"
    _fake_engine_metadata(unpatched, build.VERSION)
    code = textwrap.dedent("""\
        import sys
        import primaplug.engine
        for attempt in ("import llama_cpp", "primaplug.engine.bindings_only()", "import llama_cpp"):
            try:
                exec(attempt)
            except Exception as e:
                print(type(e).__name__, "|", e)
        print("loaded" if "llama_cpp" in sys.modules else "not loaded")
        """)
    r = _python(code, unpatched, tmp_path)
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "not loaded", r.stdout + r.stderr
    for line in lines[:3]:
        assert line.startswith("EngineError | llama-cpp-python 0.3.36 is installed, which is not primaplug's")
        assert "patch is missing" in line and "`primaplug engine build`" in line

    r = _python("import sys; from primaplug.cli import main; sys.exit(main(['run', '-p', 'x', '-n', '1']))",
                unpatched, tmp_path)
    assert r.returncode == 2 and "\nprimaplug: error: llama-cpp-python 0.3.36 is installed, which" in r.stderr

    current = tmp_path / "current"
    _fake_engine_metadata(current, CURRENT)
    r = _python("import primaplug.engine, llama_cpp, sys; print(type(sys.meta_path[0]).__name__)", current, tmp_path)
    assert r.returncode == 0 and "_ImportCheck" not in r.stdout, r.stderr
