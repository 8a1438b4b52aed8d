"""What an emulated device's programs see of its memory: /proc/meminfo as the device would show it.

A cgroup caps a device's memory, but a program that reads /proc/meminfo still sees the whole machine's. Programs
that size their work by it (prima.cpp's profiler reads MemAvailable; it reads the cgroup only inside a container)
would then plan for 24 GiB on a device of 150 MiB. LXCFS, the FUSE file system containers use for this, serves a
/proc/meminfo computed from the reading process's own memory cgroup; a program started with `enter_view` sees
that file at /proc/meminfo, in a mount namespace of its own; nothing changes for anyone else.

Needs root and Debian's `lxcfs` package; `Lxcfs` starts the daemon when it is not running and stops what it
started.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.testbed.cgroups import CgroupUnavailableError

MOUNT = Path("/var/lib/lxcfs")
VIEW_ROOT = Path("/tmp/primaplug-view")  # where each view's root is mounted, in the child's own namespace
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18


class Lxcfs:
    """The LXCFS daemon for as long as the `with` block lasts (reused when it already runs)."""

    def __init__(self, mount: Path = MOUNT) -> None:
        self.mount, self.proc = mount, None

    @property
    def meminfo(self) -> Path:
        return self.mount / "proc" / "meminfo"

    def __enter__(self) -> Lxcfs:
        VIEW_ROOT.mkdir(exist_ok=True)
        try:
            if self.meminfo.exists():
                return self
        except OSError:  # a daemon that died (the machine restarted under it) left its mount: "not connected"
            self._unmount()
        binary = shutil.which("lxcfs")
        if binary is None:
            raise CgroupUnavailableError("the emulated devices' /proc/meminfo needs LXCFS: apt-get install lxcfs")
        self.mount.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([binary, str(self.mount)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + 10
        while not self.meminfo.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""
                self._stop()
                raise CgroupUnavailableError(f"LXCFS did not start on {self.mount}: {err.strip()[-300:]}")
            time.sleep(0.05)
        return self

    def _unmount(self) -> None:
        # root's umount: fusermount comes with fuse's package, which LXCFS may be installed without (fuse3's is
        # fusermount3)
        subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)  # noqa: PLW1510

    def _stop(self) -> None:
        if self.proc is None:
            return
        self._unmount()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def __exit__(self, *exc: object) -> None:
        self._stop()


def enter_view(meminfo: Path) -> None:
    """In a child before it starts its program (after it joined its device's cgroup): a mount namespace of its own
    whose root holds the machine's directories (bound, so reads and writes go to the same disks) and no file beside
    them, and in which /proc/meminfo is LXCFS's, computed from the cgroup the child is in.

    Why a root of its own: this machine may itself be a container, with a /.dockerenv at its root, and prima.cpp
    then reads its memory from cgroup v2 files that a cgroup v1 machine lacks, and aborts; on a home device it reads
    /proc/meminfo. The files at the root (/.dockerenv among them) are a container's marks, not the device's."""
    libc = ctypes.CDLL(None, use_errno=True)

    def call(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), what)

    call(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    call(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")  # nothing leaks out
    root = VIEW_ROOT
    call(libc.mount(b"tmpfs", os.fsencode(root), b"tmpfs", 0, b"mode=755"), f"mount -t tmpfs {root}")
    for entry in os.scandir("/"):
        target = root / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            target.mkdir()
            # the folder that holds the new root itself is bound alone, not with what is mounted in it
            flags = MS_BIND | (0 if root.is_relative_to(entry.path) else MS_REC)
            call(libc.mount(os.fsencode(entry.path), os.fsencode(target), None, flags, None), f"bind {entry.path}")
    call(libc.mount(os.fsencode(meminfo), os.fsencode(root / "proc" / "meminfo"), None, MS_BIND, None),
         f"mount --bind {meminfo} /proc/meminfo")
    cwd = os.getcwd()
    os.chroot(root)
    os.chdir(cwd)
