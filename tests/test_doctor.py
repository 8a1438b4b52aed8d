"""`primaplug doctor`: each check says what it found and, where it fails, the fix; the command exits 1 when this
device cannot serve as a node. Run for real on this machine, in a memory cgroup too small for a node (root), and with
each failure made: a port taken, a key that does not load, an address off loopback without a key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from primaplug.cli import doctor
from primaplug.memory.system import MemoryView


def run_doctor(*args: str, preexec=None) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    return subprocess.run([sys.executable, "-m", "primaplug", "doctor", "--no-mdns", *args], capture_output=True,
                          text=True, timeout=120, preexec_fn=preexec)


def test_this_machine_can_serve_as_a_node(tmp_path: Path) -> None:
    out = run_doctor("--listen", "127.0.0.1:0", "--model-dir", str(tmp_path / "models"))
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("engine", "memory", "disk", "ports", "cluster key"):
        assert f"ok   {name}: " in out.stdout, out.stdout
    assert "CPU kernels: " in out.stdout and "MB/s sequential" in out.stdout
    assert "this device can serve as a node" in out.stderr


def test_each_failure_says_its_fix(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        c = doctor.ports(f"127.0.0.1:{port}")
    assert c.status == "fail" and f"cannot listen on {port}" in c.detail and "--listen" in c.fix
    c = doctor.keys(None, "192.168.1.20:7000")
    assert c.status == "fail" and "off loopback" in c.detail and "primaplug keygen" in c.fix
    (tmp_path / "bad.key").write_text("not a key")
    c = doctor.keys(str(tmp_path / "bad.key"), "127.0.0.1:7000")
    assert c.status == "fail" and "bad.key" in c.detail


def test_too_little_memory_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("primaplug.memory.system.memory_view", lambda: MemoryView(80 << 20, 30 << 20, "cgroup v1"))
    c = doctor.memory()
    assert c.status == "fail" and "30 MiB available of 80 MiB (cgroup v1)" in c.detail and "at least 96 MiB" in c.fix


def test_a_memory_cgroup_too_small_for_a_node(tmp_path: Path) -> None:
    """The real thing: the doctor in a cgroup of 112 MiB, where its own interpreter and imports take most of it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.testbed import cgroups

    group = cgroups.Cgroup(f"primaplug-doctor-{os.getpid()}", cgroups.Caps(memory_bytes=112 << 20), None)
    try:
        group.create()
    except cgroups.CgroupUnavailableError as e:
        pytest.skip(f"needs root and cgroups: {e}")
    try:
        out = run_doctor("--listen", "127.0.0.1:0", "--model-dir", str(tmp_path / "models"), preexec=group.preexec)
    finally:
        group.remove()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL memory: " in out.stdout and "fix: a node needs at least 96 MiB available" in out.stdout
    assert "1 check(s) failed" in out.stderr
