"""Android (Termux) at run time, from readings recorded on real phones (tests/fixtures/platforms/SOURCES.md): memory
as Android reports it, the paging fallback of kernels without MADV_POPULATE_READ, and Termux's wake lock (a fake
termux-wake-lock in a Termux-like prefix; one test runs a real node process with it)."""

from __future__ import annotations

import logging
import mmap
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from primaplug.core.errors import ConfigError
from primaplug.memory import android
from primaplug.memory.advice import MADV_POPULATE_READ, Advisor, Libc, paging_platform
from primaplug.memory.residency import resident_bytes
from primaplug.memory.system import linux_kernel, memory_view
from primaplug.node import wakelock
from primaplug.node.wakelock import WakeLock

FIXTURES = Path(__file__).parent / "fixtures" / "platforms" / "android"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def _dumpsys_levels() -> dict[int, int]:
    """The recorded Pixel's OOM levels: oom_score_adj -> bytes, as ActivityManager printed them."""
    rows = re.findall(r"^\s*(-?\d+): \w+ \(\s*([\d,]+)K\)$", _fixture("pixel-android12-dumpsys-activity-processes.txt"),
                      flags=re.MULTILINE)
    return {int(adj): int(k.replace(",", "")) * KiB for adj, k in rows}


# --- which OS ------------------------------------------------------------------------------------------------------


def test_android_and_termux_are_told_from_linux() -> None:
    # what Termux sets (termux/termux-packages#29018 lists them) and what Python 3.13+ reports
    termux = {"TERMUX_VERSION": "0.118.3", "PREFIX": "/data/data/com.termux/files/usr"}
    assert android.is_termux(termux) and android.is_android("Linux", termux, False)
    assert android.is_termux({"TERMUX__PREFIX": "/data/data/com.termux/files/usr"})
    assert android.is_android("Android", {}, False)  # Python 3.13+
    assert android.is_android("Linux", {}, True)  # /system/build.prop
    assert android.is_android("Linux", {"ANDROID_ROOT": "/system", "ANDROID_DATA": "/data"}, False)
    assert not android.is_android("Linux", {"PREFIX": "/usr", "ANDROID_HOME": "/opt/sdk"}, False)
    assert not android.is_termux({"PREFIX": "/usr/local"})
    assert paging_platform("android") == paging_platform("linux") == "linux"


def test_androids_kernel_is_linuxs() -> None:
    assert linux_kernel("linux") and linux_kernel("android")  # Python before 3.13 on a phone, and from 3.13 on
    assert not linux_kernel("darwin") and not linux_kernel("freebsd14") and not linux_kernel("win32")


def test_a_node_on_android_holds_its_model_files_through_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Python 3.13+ on Android: the held file is read through /proc/self/fd, as on Linux, not by its name."""
    from primaplug.node.files import HeldFile

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    for name, by_fd in (("android", True), ("darwin", False)):
        monkeypatch.setattr(sys, "platform", name)
        held = HeldFile(path)
        try:
            assert held.by_fd == by_fd, name
            assert held.path == (f"/proc/self/fd/{held.fd}" if by_fd else str(path))
        finally:
            held.close()


@pytest.mark.skipif(not linux_kernel(), reason="sets PR_SET_PDEATHSIG, which only Linux's kernel has")
def test_local_nodes_on_android_are_killed_with_their_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's child setup asks Android's kernel, as Linux's, for SIGTERM when the launcher dies (the
    setting survives exec: the child reads it back with PR_GET_PDEATHSIG)."""
    from primaplug.head.launch import _child_setup

    code = "import ctypes; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s)); print(s.value)"
    for name, signum in (("android", signal.SIGTERM), ("darwin", 0)):
        monkeypatch.setattr(sys, "platform", name)
        setup = _child_setup(None)
        out = subprocess.run([sys.executable, "-c", code], preexec_fn=setup, capture_output=True, text=True,
                             check=True, timeout=60).stdout
        assert int(out) == signum, name


# --- lmkd's levels and Android's low-memory line ---------------------------------------------------------------------


@pytest.mark.parametrize("total", [1 * GiB, 4 * GiB, 12 * GiB])
def test_aosp_default_levels_are_the_ones_a_real_pixel_reports(total: int) -> None:
    """ActivityManager's levels on the recorded Pixel (64-bit) are AOSP's defaults, whatever the memory above
    700 MB; getMemLevel's rule (the first slot at least as high) gives every row of dumpsys, 225 and 999 too."""
    levels = android.default_levels(total, is_64bit=True)
    recorded = _dumpsys_levels()
    assert len(recorded) == 16
    assert {adj: levels.mem_level(adj) for adj in recorded} == recorded
    assert levels.low_memory_bytes() == recorded[android.CACHED_APP_MIN_ADJ] == 221184 * KiB  # 216 MiB


def test_termux_runs_as_a_perceptible_foreground_service() -> None:
    """The recorded Termux process in the background: oom adj 200 with a foreground service, below the cached
    apps lmkd kills first (what docs/platforms.md relies on)."""
    text = _fixture("pixel-android12-dumpsys-activity-processes.txt")
    assert "cur=200" in text and "mHasForegroundServices=true" in text
    assert android.PERCEPTIBLE_APP_ADJ == 200 < android.CACHED_APP_MIN_ADJ


def test_minfree_levels_property_in_lmkd_format() -> None:
    # CONSTRUCTED: no recorded `getprop sys.lmk.minfree_levels` could be sourced (fixtures SOURCES.md); this is the
    # recorded Pixel's levels written as lmkd's cmd_target writes the property ("%d:%d," pages:adj)
    value = "18432:0,23040:100,27648:200,32256:250,55296:900,80640:950"
    levels = android.parse_minfree_levels(value, page_size=4096)
    assert levels is not None and levels.source == "sys.lmk.minfree_levels"
    recorded = _dumpsys_levels()
    assert all(levels.mem_level(adj) == recorded[adj] for adj in recorded)
    bigger = android.parse_minfree_levels(value, page_size=16384)  # 16 KiB pages: the counts are in pages
    assert bigger is not None and bigger.low_memory_bytes() == 4 * levels.low_memory_bytes()
    for bad in ("", "18432", "a:b", "18432:0,,23040:100"):
        assert android.parse_minfree_levels(bad, 4096) is None


@pytest.mark.parametrize("dump", ["pixel8pro-android16-getprop.txt", "oneplus-nord-n10-android11-getprop.txt"])
def test_getprop_dumps_of_recent_phones_hide_the_levels(dump: str) -> None:
    """Neither phone's getprop shows sys.lmk.minfree_levels (the shell cannot read it, nor can an app), so the
    levels are AOSP's, for a 64-bit device as ro.product.cpu.abilist64 says."""
    props = android.parse_getprop(_fixture(dump))
    assert props["ro.product.cpu.abilist64"] == "arm64-v8a" and "sys.lmk.minfree_levels" not in props
    levels = android.lmk_levels(props, 8 * GiB, 4096, machine="armv8l")  # the property wins over the machine
    assert levels == android.default_levels(8 * GiB, is_64bit=True)
    assert levels.low_memory_bytes() == 221184 * KiB
    assert props["sys.sysctl.extra_free_kbytes"].isdigit()


def test_32_bit_and_small_devices_get_lower_levels() -> None:
    # CONSTRUCTED inputs: an empty abilist64 (a 32-bit userspace), and memory sizes; the tables are AOSP's
    props32 = {"ro.product.cpu.abilist64": ""}
    assert android.lmk_levels(props32, 2 * GiB, 4096, "aarch64").low_memory_bytes() == 147456 * KiB
    assert android.lmk_levels({}, 2 * GiB, 4096, "armv7l").low_memory_bytes() == 147456 * KiB
    assert android.lmk_levels({}, 2 * GiB, 4096, "aarch64").low_memory_bytes() == 221184 * KiB
    # 525 MB: halfway between the small (43008 KiB) and the large (147456 KiB) table
    assert android.default_levels(525 * MiB, False).mem_level(900) == (43008 + (147456 - 43008) // 2) * KiB
    assert android.default_levels(300 * MiB, False).mem_level(900) == 43008 * KiB


# --- the memory view ------------------------------------------------------------------------------------------------


def test_a_phones_available_memory_leaves_androids_low_memory_line() -> None:
    view = android.android_view(_fixture("goadb-meminfo.txt"), android.default_levels(3681628 * KiB, True))
    assert view.source == "android" and view.total_bytes == 3681628 * KiB
    assert view.available_bytes == (2243756 - 221184) * KiB  # MemAvailable less 216 MiB
    assert "MemAvailable" in view.note and "216 MiB" in view.note


def test_a_kernel_without_memavailable_counts_free_and_cached_as_android_does() -> None:
    text = _fixture("goclever-insignia5-meminfo.txt")
    assert "MemAvailable" not in text  # a 3.x kernel, 32-bit, 1 GiB
    view = android.android_view(text, android.lmk_levels({}, 990732 * KiB, 4096, "armv7l"))
    assert view.available_bytes == (221132 + 337052 - 147456) * KiB
    assert view.note.startswith("MemFree + Cached")


def test_no_memory_is_available_below_the_line() -> None:
    # CONSTRUCTED: the recorded 1 GiB phone's levels against a meminfo with 100 MiB available
    meminfo = "MemTotal:  990732 kB\nMemFree:  50000 kB\nMemAvailable:  102400 kB\n"
    assert android.android_view(meminfo, android.default_levels(990732 * KiB, False)).available_bytes == 0
    with pytest.raises(ValueError, match="MemTotal"):
        android.android_view("Active: 1 kB\n", android.default_levels(GiB, True))


def test_an_apps_cgroups_are_looked_up_where_android_mounts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded background app's cgroups: v1 memory at the root (/dev/memcg on Android), v2 per uid and pid
    (/sys/fs/cgroup). SELinux keeps an app from reading them, and then there is no limit."""
    cgroup = _fixture("chromium-background-app-cgroup.txt")
    asked: list[str] = []

    def read(path: str) -> str | None:
        asked.append(path)
        return {"/proc/meminfo": _fixture("goadb-meminfo.txt"), "/proc/self/cgroup": cgroup}.get(path)

    monkeypatch.setattr(android, "_levels", None)
    calls: list[list[str]] = []
    getprop = _fixture("pixel8pro-android16-getprop.txt")
    view = android.read_android_view(read, lambda argv: calls.append(argv) or getprop)
    assert "/dev/memcg/memory.limit_in_bytes" in asked
    assert "/sys/fs/cgroup/uid_10179/pid_11869/memory.max" in asked
    assert view.source == "android" and view.available_bytes == (2243756 - 221184) * KiB
    android.read_android_view(read, lambda argv: calls.append(argv) or getprop)
    assert len(calls) == 1  # the levels are read once a process
    # CONSTRUCTED: a v2 limit Android could set on the app's group (Android sets none by default)
    limited = {"/sys/fs/cgroup/uid_10179/pid_11869/memory.max": str(GiB), "/sys/fs/cgroup/uid_10179/pid_11869/"
               "memory.current": str(300 * MiB)}
    view = android.read_android_view(lambda p: limited.get(p) or read(p), lambda argv: None)
    assert view.source == "android cgroup v2" and view.total_bytes == GiB
    assert view.available_bytes == GiB - 300 * MiB


def test_this_machine_read_as_android(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live path on this machine's own /proc/meminfo (no getprop here: AOSP's levels for this machine)."""
    monkeypatch.setattr(android, "_levels", None)
    view = memory_view("android")
    assert view.source.startswith("android") and view.note
    info = android.parse_meminfo(Path("/proc/meminfo").read_text())
    assert android._levels == android.lmk_levels({}, info["MemTotal"], mmap.PAGESIZE, platform.machine())
    line = android._levels.low_memory_bytes()
    assert view.available_bytes <= max(0, info["MemAvailable"] - line) + 256 * MiB  # moments apart


# --- paging on Android kernels before 5.14 ---------------------------------------------------------------------------


class NoPopulateLibc(Libc):
    """A kernel without MADV_POPULATE_READ (Linux < 5.14, most Android phones): madvise refuses it with EINVAL."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def madvise(self, addr: int, length: int, advice: int) -> int:
        if advice == MADV_POPULATE_READ:
            self.refused += 1
            return -1
        return super().madvise(addr, length, advice)

    def errno(self) -> int:
        return 22 if self.refused else super().errno()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="drops the file from the page cache to measure")
def test_prefetch_without_populate_read_reads_the_range(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(8 * MiB))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)  # as llama.cpp maps it
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if resident_bytes(path, [(0, 8 * MiB)]) > MiB:
            pytest.skip("the file stayed cached; cannot measure")
        libc = NoPopulateLibc()
        advisor = Advisor(str(path), platform="linux", libc=libc)
        assert advisor.populate and "POPULATE_READ" in advisor.mode
        assert advisor.prefetch([(MiB, 2 * MiB)]) == 2 * MiB
        assert libc.refused == 1 and not advisor.populate and "no MADV_POPULATE_READ" in advisor.mode
        assert resident_bytes(path, [(MiB, 2 * MiB)]) == 2 * MiB
        assert advisor.prefetch([(4 * MiB, MiB)]) == MiB and libc.refused == 1  # reads from now on
        assert resident_bytes(path, [(4 * MiB, MiB)]) == MiB
        advisor.close()
    finally:
        mapping.close()
        os.close(fd)


# --- Termux's wake lock ----------------------------------------------------------------------------------------------


def _termux(tmp_path: Path, *, lock_stderr: str = "", lock_exit: int = 0, on_path: bool = True) -> dict[str, str]:
    """A Termux-like prefix with fake termux-wake-lock/unlock that log their calls."""
    bin_dir = tmp_path / "usr" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    for name, word in ((wakelock.LOCK, "lock"), (wakelock.UNLOCK, "unlock")):
        script = bin_dir / name
        extra = f"echo '{lock_stderr}' >&2\nexit {lock_exit}\n" if word == "lock" else ""
        script.write_text(f"#!/bin/sh\necho {word} >> '{log}'\n{extra}")
        script.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin" if on_path else "/usr/bin:/bin"
    return {"PREFIX": str(tmp_path / "usr"), "TERMUX_VERSION": "0.118.3", "PATH": path, "HOME": str(tmp_path)}


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().split() if log.exists() else []


@pytest.mark.parametrize("on_path", [True, False])
def test_auto_takes_the_lock_under_termux_and_releases_it(tmp_path: Path, on_path: bool) -> None:
    env = _termux(tmp_path, on_path=on_path)  # not on PATH: found in $PREFIX/bin
    with WakeLock("auto", env=env) as lock:
        assert lock.held and _calls(tmp_path) == ["lock"]
    assert not lock.held and _calls(tmp_path) == ["lock", "unlock"]


def test_auto_does_nothing_outside_termux(tmp_path: Path) -> None:
    env = _termux(tmp_path)
    del env["TERMUX_VERSION"], env["PREFIX"]
    with WakeLock("auto", env=env) as lock:
        assert not lock.held
    with WakeLock("off", env=_termux(tmp_path / "t")) as lock:
        assert not lock.held
    assert _calls(tmp_path) == [] and _calls(tmp_path / "t") == []


def test_on_takes_it_wherever_the_command_is(tmp_path: Path) -> None:
    env = _termux(tmp_path)
    del env["TERMUX_VERSION"], env["PREFIX"]  # not Termux, but the command is on PATH
    with WakeLock("on", env=env):
        pass
    assert _calls(tmp_path) == ["lock", "unlock"]


def test_a_missing_command_warns_under_auto_and_stops_the_node_under_on(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    env = {"PREFIX": str(tmp_path / "usr"), "TERMUX_VERSION": "0.118.3", "PATH": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="primaplug.node.wakelock"), WakeLock("auto", env=env) as lock:
        assert not lock.held
    assert "termux-wake-lock not found" in caplog.text and "pkg install termux-tools" in caplog.text
    with pytest.raises(ConfigError, match="pkg install termux-tools"):
        WakeLock("on", env=env).acquire()


def test_a_refused_lock_is_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """termux-wake-lock exits 0 when `am` fails and says "Failed to acquire wake lock" (termux-tools' script)."""
    env = _termux(tmp_path, lock_stderr="Failed to acquire wake lock")
    with caplog.at_level(logging.WARNING, logger="primaplug.node.wakelock"), WakeLock("auto", env=env) as lock:
        assert not lock.held
    assert "Failed to acquire wake lock" in caplog.text
    assert _calls(tmp_path) == ["lock"]  # nothing held, so nothing released
    with pytest.raises(ConfigError, match="exit 0.*Failed to acquire"):
        WakeLock("on", env=env).acquire()
    env = _termux(tmp_path / "exit", lock_exit=3)
    with pytest.raises(ConfigError, match="exit 3"):
        WakeLock("on", env=env).acquire()


def test_a_mode_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto, on, off"):
        WakeLock("always")


def test_the_node_commands_flag_takes_what_the_wake_lock_takes() -> None:
    """Every value the flag accepts (core/settings.py's modes) makes a WakeLock, the default is auto, and the
    command's module loads neither the node nor the engine to know them."""
    import argparse

    from primaplug.cli import node as node_cli

    parser = argparse.ArgumentParser()
    node_cli.add_parser(parser.add_subparsers())
    parse = parser.parse_args
    assert parse(["node", "-m", "m.gguf"]).wake_lock == "auto" == WakeLock().mode
    for mode in ("auto", "on", "off"):
        assert WakeLock(parse(["node", "-m", "m.gguf", "--wake-lock", mode]).wake_lock, env={}).mode == mode
    with pytest.raises(SystemExit):
        parse(["node", "-m", "m.gguf", "--wake-lock", "always"])
    code = ("import sys, primaplug.cli.node; bad = {'primaplug.node', 'llama_cpp'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


@pytest.mark.multiproc
def test_a_node_process_holds_the_lock_while_it_runs(gemma_path: Path, tmp_path: Path) -> None:
    """A real `primaplug node` in a Termux-like environment: the lock before "ready", the release after SIGTERM,
    and its memory read the Android way (the node logs Android's low-memory line)."""
    env = {**os.environ, **_termux(tmp_path)}
    env["PATH"] = f"{tmp_path / 'usr' / 'bin'}:{os.environ['PATH']}"
    proc = subprocess.Popen([sys.executable, "-m", "primaplug", "node", "-m", str(gemma_path), "--listen",
                             "127.0.0.1:0", "-v"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "ready" in line, line + (proc.stderr.read() if proc.stderr else "")
        assert _calls(tmp_path) == ["lock"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert _calls(tmp_path) == ["lock", "unlock"]
    assert "holding Termux's wake lock" in err and "released Termux's wake lock" in err
    assert "Android's low-memory line" in err
