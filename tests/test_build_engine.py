"""The engine build (primaplug/engine/build.py, through scripts/build_engine.py): cache keys, the engine's version
label, patch failures that name the patch and hunk, no rebuild when nothing changed, --no-install, and primaplug's
own wheel, which carries the patches and never depends on llama-cpp-python."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def build():
    """primaplug/engine/build.py as scripts/build_engine.py loads it: by path, through nothing of primaplug."""
    spec = importlib.util.spec_from_file_location("build_engine_script", ROOT / "scripts" / "build_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.load_build()


def test_installed_engine_is_the_current_build(build) -> None:
    """What `make test` installed is the build of the current patches, so running it again rebuilds nothing."""
    found = build.inspect_version(build.installed_version(sys.executable))
    assert found.ready, found.problem
    if found.key == build.build_key("cpu"):
        assert build.main(["--gpu", "cpu"]) == 0  # finds it installed and returns at once


def test_the_version_a_process_reads_is_importlib_metadatas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ensure.installed_version reads the .dist-info folder itself (a node saves importlib.metadata's 2.7 MiB): the
    same answer, the first folder on sys.path wins as importlib.metadata's does, and None where there is none."""
    import importlib.metadata

    from primaplug.engine.ensure import installed_version

    assert installed_version() == importlib.metadata.version("llama-cpp-python")
    first = tmp_path / "first" / "llama_cpp_python-9.9.9.dist-info"
    first.mkdir(parents=True)
    (first / "METADATA").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 9.9.9+x\n\nVersion: no\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(tmp_path / "first"), *sys.path])
    assert installed_version() == "9.9.9+x"
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing")])
    assert installed_version() is None


def test_the_script_needs_only_the_standard_library(build) -> None:
    """Without site-packages (python -S) the script still runs: it is what installs everything else."""
    r = subprocess.run([sys.executable, "-S", "-I", str(ROOT / "scripts" / "build_engine.py"), "--gpu", "cpu",
                        "--print-key"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == build.build_key("cpu")
    r = subprocess.run([sys.executable, "-S", "-I", str(ROOT / "scripts" / "build_engine.py"), "--help"],
                       capture_output=True, text=True)
    assert "--no-install" in r.stdout and "--wheel-dir" in r.stdout


def test_key_follows_flags_and_patches(build, monkeypatch, tmp_path) -> None:
    cpu, cuda = build.build_key("cpu"), build.build_key("cuda")
    digest = build.patch_digest()
    assert cpu != cuda and cpu == build.build_key("cpu")
    monkeypatch.setenv("PRIMAPLUG_CMAKE_ARGS", "-DGGML_AVX512=OFF")
    assert build.build_key("cpu") != cpu
    assert build.patch_digest() == digest  # the flags are not the source
    monkeypatch.delenv("PRIMAPLUG_CMAKE_ARGS")
    patches = tmp_path / "patches"
    patches.mkdir()
    for p in build.patch_files():
        (patches / p.name).write_bytes(p.read_bytes())
    (patches / "series").write_text((build.PATCHES / "series").read_text())
    monkeypatch.setattr(build, "PATCHES", patches)
    assert build.build_key("cpu") == cpu and build.patch_digest() == digest
    first = build.patch_files()[0]
    first.write_text(first.read_text() + "\n")
    assert build.build_key("cpu") != cpu
    assert build.patch_digest() != digest


def test_a_native_build_under_a_hypervisor_that_advertises_amx_leaves_amx_out(build, monkeypatch) -> None:
    """ggml's AMX kernels died of SIGILL on a VM whose CPU advertised AMX (build.py: NO_AMX_FLAGS): a native build
    there is made without them, and the key says so; a build that is not native, or a CPU without AMX, keeps its
    flags."""
    flags = "flags\t\t: fpu sse4_2 avx2 avx512f avx512_vnni"
    vm = "processor\t: 0\n" + flags + " amx_tile amx_int8 hypervisor\n"
    assert build.amx_under_hypervisor(vm)
    assert not build.amx_under_hypervisor(vm.replace(" hypervisor", ""))  # bare metal: AMX runs
    assert not build.amx_under_hypervisor(vm.replace(" amx_int8", ""))
    assert not build.amx_under_hypervisor("")
    monkeypatch.setattr(build, "amx_under_hypervisor", lambda cpuinfo=None: False)
    plain = build.build_key("cpu")
    assert not set(build.NO_AMX_FLAGS) & set(build.cmake_flags("cpu"))
    monkeypatch.setattr(build, "amx_under_hypervisor", lambda cpuinfo=None: True)
    assert set(build.NO_AMX_FLAGS) <= set(build.cmake_flags("cpu"))
    assert set(build.NO_AMX_FLAGS) <= set(build.cmake_flags("cuda"))  # a CUDA build's CPU backend too
    assert build.build_key("cpu") != plain
    monkeypatch.setenv("PRIMAPLUG_CMAKE_ARGS", "-DGGML_NATIVE=OFF")
    assert not set(build.NO_AMX_FLAGS) & set(build.cmake_flags("cpu"))


def test_label_says_which_patches_and_any_backend_is_accepted(build, monkeypatch, tmp_path) -> None:
    for gpu in build.GPU_FLAGS:
        label = build.engine_label(gpu, build.build_key(gpu))
        assert str(Version(label)) == label  # the wheel's metadata keeps it as written
        found = build.inspect_version(label)
        assert found.ready and found.gpu == gpu and found.problem == ""
    # a CUDA build with flags this process does not have (its key is not ours) is still of the current patches
    assert build.inspect_version(build.engine_label("cuda", "0123456789abcdef")).ready
    # engines labelled before the label carried the patches: accepted when their key is one of this machine's
    assert build.inspect_version(f"{build.VERSION}+primaplug.{build.build_key('cpu')}").ready
    legacy = build.inspect_version(f"{build.VERSION}+primaplug.0123456789abcdef")
    assert not legacy.ready and "other patches" in legacy.problem

    missing = build.inspect_version(None)
    assert not missing.ready and "not installed" in missing.problem
    for other in (build.VERSION, "0.3.35", "0.3.36+cu124", "0.3.35+primaplug.cpu.p0123456789ab.k0123456789abcdef"):
        found = build.inspect_version(other)
        assert not found.ready and "not primaplug's patched build" in found.problem, other

    label = build.engine_label("cpu", build.build_key("cpu"))
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("0001-a.patch\n")
    (patches / "0001-a.patch").write_text("--- a/x\n+++ b/x\n")
    monkeypatch.setattr(build, "PATCHES", patches)
    found = build.inspect_version(label)
    assert not found.ready and "other patches" in found.problem


def test_default_gpu(build, monkeypatch) -> None:
    monkeypatch.setenv("PRIMAPLUG_GPU", "cuda")
    assert build.default_gpu() == "cuda"
    monkeypatch.setenv("PRIMAPLUG_GPU", "vulkan")
    with pytest.raises(build.BuildError, match="PRIMAPLUG_GPU=vulkan"):
        build.default_gpu()
    monkeypatch.delenv("PRIMAPLUG_GPU")
    monkeypatch.setattr(build.sys, "platform", "darwin")
    monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
    assert build.default_gpu() == "metal"
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert build.default_gpu() == "cpu"


@pytest.mark.parametrize("env", ["PRIMAPLUG_CACHE", "XDG_CACHE_HOME", None])
def test_the_cache_is_core_settings_and_status_says_where_it_comes_from(build, monkeypatch, tmp_path, capsys,
                                                                       env) -> None:
    """build.py repeats core.settings.cache_root's rule (it cannot import it): the two give the same folder, and
    `primaplug engine status` names the variable it came from, or says it is the default."""
    from primaplug.cli import engine as engine_cli
    from primaplug.core.settings import cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("PRIMAPLUG_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv(env, str(tmp_path / env))
    folder, origin = build.cache_location()
    assert folder == cache_root() == {"PRIMAPLUG_CACHE": tmp_path / "PRIMAPLUG_CACHE",
                                      "XDG_CACHE_HOME": tmp_path / "XDG_CACHE_HOME" / "primaplug",
                                      None: tmp_path / "home" / ".cache" / "primaplug"}[env]
    assert origin.startswith({"PRIMAPLUG_CACHE": "$PRIMAPLUG_CACHE", "XDG_CACHE_HOME": "$XDG_CACHE_HOME/primaplug",
                              None: "the default"}[env])
    engine_cli.status()
    assert f"cache:    {folder} ({origin})" in capsys.readouterr().out


def test_no_install_copies_the_cached_wheel(build, tmp_path, capsys) -> None:
    """--no-install --wheel-dir: the wheel of this machine's key (cached by `make setup`), nothing installed."""
    key = build.build_key("cpu")
    if build.cached_wheel(key) is None:
        pytest.skip(f"no cached CPU wheel for key {key} in {build.cache_dir()} (make setup caches it)")
    before = build.installed_version(sys.executable)
    assert build.main(["--gpu", "cpu", "--no-install", "--wheel-dir", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [build.cached_wheel(key).name]
    assert "not installed" in capsys.readouterr().out
    assert build.installed_version(sys.executable) == before


def test_missing_tools_stop_the_build_before_it_starts(build, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))  # no cached wheel
    missing = build.missing_tools()
    assert missing[:2] == ["patch", "cmake"] and len(missing) == 4
    with pytest.raises(build.BuildError, match="needs patch, cmake, a C compiler"):
        build.build_engine(sys.executable, "cpu", install_it=False)
    assert not (tmp_path / "cache" / "sdist").exists()  # nothing downloaded


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


def test_primaplug_never_depends_on_llama_cpp_python() -> None:
    """pip must never install (or build) PyPI's unpatched llama-cpp-python for primaplug, extras included; the
    engine's own runtime dependencies and its server's are listed instead."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert not [r for r in requirements if r.lower().replace("_", "-").startswith("llama-cpp-python")]
    names = {r.split(">")[0].split("=")[0].split("<")[0].split(";")[0].strip().lower() for r in requirements}
    assert {"numpy", "jinja2", "diskcache", "typing-extensions"} <= names  # llama-cpp-python's own
    assert {"uvicorn", "fastapi", "pydantic-settings", "sse-starlette", "starlette-context", "pyyaml"} <= names


def test_the_wheel_carries_the_patches(tmp_path) -> None:
    """primaplug's wheel has patches/ as primaplug/engine/patches, which build.py finds there once installed."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    for folder in ("patches", "primaplug"):
        subprocess.run(["cp", "-r", str(ROOT / folder), str(src / folder)], check=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                        str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("primaplug-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    series = [ln.strip() for ln in (ROOT / "patches" / "series").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert {f"primaplug/engine/patches/{n}" for n in [*series, "series"]} <= names
    assert "primaplug/engine/build.py" in names and "primaplug/engine/ensure.py" in names
    requires = [ln for ln in metadata.splitlines() if ln.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if "llama-cpp-python" in r.lower().replace("_", "-")]


def _script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(("body", "expected"), [
    ("echo 'cmake version 3.31.6'", None),
    ("echo 'ModuleNotFoundError: No module named cmake' >&2; exit 1", "a cmake that runs"),
    ("echo 'cmake version 3.18.4'", "cmake 3.21 or newer"),
])
def test_a_cmake_that_does_not_run_or_is_too_old_is_named(build, monkeypatch, tmp_path, body, expected) -> None:
    """PyPI's cmake on PATH outside its environment fails to run (an offline GPU machine: pip then asked an index
    for cmake>=3.21); an old one would be replaced by a download. Both are named before the build starts."""
    _script(tmp_path, "cmake", body)
    monkeypatch.setenv("PATH", str(tmp_path))
    missing = [m for m in build.missing_tools() if "cmake" in m]
    if expected is None:
        assert missing == []
    else:
        assert len(missing) == 1 and missing[0].startswith(expected), missing


def test_the_build_uses_the_environment_s_backend_where_it_has_one(build, tmp_path) -> None:
    """With scikit-build-core in the environment the build runs without pip's isolated environment (no download);
    without it, or too old, pip's isolation fetches it."""
    assert build.backend_version(str(_script(tmp_path, "py-with", "echo 0.10.7"))) == (0, 10, 7)
    assert build.backend_version(str(_script(tmp_path, "py-without", "exit 1"))) is None
    assert build.backend_version(str(tmp_path / "no-such-python")) is None
    assert (0, 9, 1) < build.BACKEND_MIN <= (0, 10, 7)


def test_the_engine_holds_each_library_once() -> None:
    """A wheel stores a symlink as a copy: built with versioned libraries, the engine held each three times (a 260 MB
    CUDA wheel), and opening the wrong copy of libggml-cpu gave NaNs (engine/_native.py: _sibling)."""
    from primaplug.profiler.gpu import engine_lib_names

    names = engine_lib_names()
    libs = [n for n in names if n.startswith("lib") and (".so" in n or n.endswith(".dylib"))]
    assert any(n.startswith("libllama") for n in libs), names
    stems = [n.split(".", 1)[0] for n in libs]
    assert len(stems) == len(set(stems)), f"a library under several names: {sorted(libs)}"


def test_a_local_source_replaces_the_sdist_and_has_its_own_key(build, monkeypatch, tmp_path) -> None:
    """PRIMAPLUG_ENGINE_SOURCE: a folder or a .tar.gz of llama-cpp-python's source (scripts/trim_sdist.py's 4 MB
    copy, for a machine that can be sent little) is built instead of the sdist, under a key of its own; a missing
    one is named."""
    import io
    import tarfile

    monkeypatch.delenv("PRIMAPLUG_ENGINE_SOURCE", raising=False)
    pinned = build.build_key("cpu")
    tree = tmp_path / "tree" / f"llama_cpp_python-{build.VERSION}"
    (tree / "llama_cpp").mkdir(parents=True)
    (tree / "llama_cpp" / "__init__.py").write_text("x = 1\n")
    packed = tmp_path / "src.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    for source in (tree, packed):
        out = tmp_path / f"unpacked-{source.name}"
        out.mkdir()
        src = build.unpack_source(source, out)
        assert (src / "llama_cpp" / "__init__.py").read_text() == "x = 1\n"
        monkeypatch.setenv("PRIMAPLUG_ENGINE_SOURCE", str(source))
        assert build.engine_source(sys.executable, io.StringIO()) == source
        assert build.build_key("cpu") != pinned
    monkeypatch.setenv("PRIMAPLUG_ENGINE_SOURCE", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(build.BuildError, match="no such file or folder"):
        build.engine_source(sys.executable, io.StringIO())
    other = tmp_path / "other.tar.gz"  # a tarball of something else
    with tarfile.open(other, "w:gz") as tar:
        tar.add(tree / "llama_cpp", arcname="llama_cpp")
    (tmp_path / "unpacked-other").mkdir()
    with pytest.raises(build.BuildError, match=f"holds no llama_cpp_python-{build.VERSION}/ folder"):
        build.unpack_source(other, tmp_path / "unpacked-other")


def test_the_trimmed_sdist_keeps_what_the_build_reads() -> None:
    spec = importlib.util.spec_from_file_location("trim_sdist", ROOT / "scripts" / "trim_sdist.py")
    trim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trim)
    v = trim.VENDOR
    for name in (v + "src/llama.cpp", v + "ggml/src/ggml-cpu/ops.cpp", v + "ggml/src/ggml-cuda/mmq.cu",
                 v + "ggml/src/ggml.c", v + "CMakeLists.txt", trim.ROOT + "llama_cpp/llama_cpp.py",
                 trim.ROOT + "CMakeLists.txt"):
        assert trim.kept(name), name
    for name in (v + "models/ggml-vocab-qwen2.gguf", v + "docs/ops/CPU.csv", v + "ggml/src/ggml-vulkan/a.cpp",
                 v + "tools/server/server.cpp", trim.ROOT + ".git/modules/x", v + "tests/test-ops.cpp"):
        assert not trim.kept(name), name


def test_a_wheel_keeps_only_the_package_and_can_be_retagged(build, tmp_path: Path) -> None:
    """vendored llama.cpp's install rules put a second copy of every library (and the headers) at the wheel's root:
    tidy_wheel keeps llama_cpp/ and the metadata, with a RECORD that pip accepts, and retags a cross-built wheel."""
    import base64
    import hashlib

    info = "llama_cpp_python-0.3.36+primaplug.cpu.dist-info"
    wheel = tmp_path / "llama_cpp_python-0.3.36+primaplug.cpu-py3-none-linux_x86_64.whl"
    files = {"llama_cpp/__init__.py": b"x = 1\n", "llama_cpp/lib/libllama.so": b"\x7fELF lib",
             "lib/libllama.so": b"\x7fELF lib", "include/llama.h": b"/* h */", f"{info}/METADATA": b"Name: x\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-linux_x86_64\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files))

    tidy = build.tidy_wheel(wheel)
    assert tidy == wheel
    with zipfile.ZipFile(tidy) as z:
        assert sorted(z.namelist()) == sorted(["llama_cpp/__init__.py", "llama_cpp/lib/libllama.so",
                                               f"{info}/METADATA", f"{info}/WHEEL", f"{info}/RECORD"])
        record = dict(ln.split(",", 1) for ln in z.read(f"{info}/RECORD").decode().splitlines())
        for name in z.namelist():
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert record[name] == f"sha256={digest},{len(data)}"

    arm = build.tidy_wheel(tidy, "linux_aarch64")
    assert arm.name == "llama_cpp_python-0.3.36+primaplug.cpu-py3-none-linux_aarch64.whl" and not tidy.exists()
    with zipfile.ZipFile(arm) as z:
        assert "Tag: py3-none-linux_aarch64" in z.read(f"{info}/WHEEL").decode()
