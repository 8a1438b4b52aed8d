"""The slow rung's other platforms (scripts/rungs/, docs/platforms.md "Other CPUs and toolchains"): each test runs
one rung's command as people run it and holds it to its exit status, and skips, saying why, where its tools are
missing. Minutes to an hour each: `make test-slow` (or `make rungs`) runs them, `make test` leaves them out.

- Debian 13 (a debootstrap chroot): `make setup`, the window, streaming and ring tests, `run --verify`;
- aarch64 under qemu-user: ARM's kernels (two CPU classes) against plain llama-cpp-python, bit for bit; then a
  ring of an emulated ARM node and an x86 one, whose `--verify` reports the mixed-kernel promise;
- the engine with AddressSanitizer and UndefinedBehaviorSanitizer under the tests that load, stream, batch, rewind
  and fuzz."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parent.parent
RUNGS = ROOT / "scripts" / "rungs"


def needs(*tools: str, root: bool = True) -> None:
    if root and os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, chroot and mounts): run `sudo make rungs`")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: apt-get install debootstrap qemu-user-static "
                    "gcc-aarch64-linux-gnu g++-aarch64-linux-gnu)")


def rung(script: str, *args: str, timeout: float = 3 * 3600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(RUNGS / script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if out.returncode == 2:
        pytest.fail(f"{script} could not run:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out


def test_debian13_builds_and_gives_plain_tokens(tmp_path: Path) -> None:
    needs("debootstrap", "git")
    out = rung("debian13.sh", str(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert (tmp_path / "debian13.json").exists()


def test_arm_kernels_give_plain_llama_bits_under_emulation(tmp_path: Path) -> None:
    needs("debootstrap", "qemu-aarch64-static", "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "git")
    out = rung("arm64.sh", str(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def test_a_ring_of_arm_and_x86_is_held_to_the_mixed_cpu_promise(tmp_path: Path) -> None:
    needs("debootstrap", "qemu-aarch64-static", "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "git")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mixed_cpus.py"), "--quick",
                          "--out", str(tmp_path / "mixed.json")], capture_output=True, text=True, timeout=3600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "mixes kernels" in out.stderr and "within the mixed-kernel promise" in out.stderr, out.stderr[-4000:]


def test_the_sanitized_engine_reports_nothing(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc with its sanitizer runtimes (apt-get install build-essential)")
    out = rung("sanitize.sh", str(tmp_path), timeout=2 * 3600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
