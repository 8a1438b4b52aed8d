"""`primaplug doctor`: whether this device can serve as a node, each check with its fix.

It exits 1 when a check fails that would keep a node from serving (no engine, too little memory, a port taken, a
key that does not load, a non-loopback address without a key, a full disk), 0 otherwise; warnings (mDNS, Termux's
wake lock and battery) say what they cost without failing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primaplug.core.settings import DEFAULT_PORT

# what a node needs available at the least: its runtime (about 35 MiB: the interpreter, numpy, llama.cpp's bindings,
# ZeroMQ; docs/peers.md) and room for a small window and its cache
MIN_NODE_BYTES = 96 << 20
DISK_TEST_BYTES = 64 << 20


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str
    fix: str = ""


def add_parser(sub: Any) -> None:
    doctor = sub.add_parser("doctor", help="check whether this device can serve as a node, each check with its fix")
    doctor.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}",
                        help=f"the address the node would listen on (default 127.0.0.1:{DEFAULT_PORT})")
    doctor.add_argument("--model-dir", metavar="DIR",
                        help="the node's model folder (default: models/ in primaplug's cache)")
    doctor.add_argument("--keys", help="the cluster key file the node would use")
    doctor.add_argument("--no-mdns", action="store_true", help="skip the mDNS check (3 s)")
    doctor.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from primaplug.cli.node import default_model_dir

    folder = Path(args.model_dir) if args.model_dir else default_model_dir()
    checks: list[Callable[[], Check]] = [engine, memory, lambda: disk(folder), lambda: ports(args.listen),
                                         lambda: keys(args.keys, args.listen)]
    if not args.no_mdns:
        checks.append(mdns)
    checks += termux()
    failed = 0
    for run in checks:
        try:
            c = run()
        except Exception as e:  # a check that breaks is a finding, not the doctor's end
            c = Check(getattr(run, "__name__", "check"), "fail", f"{type(e).__name__}: {e}")
        failed += c.status == "fail"
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}[c.status]
        print(f"{mark} {c.name}: {c.detail}" + (f"\n     fix: {c.fix}" if c.fix else ""), flush=True)
    print(f"primaplug doctor: {'this device can serve as a node' if not failed else f'{failed} check(s) failed'}",
          file=sys.stderr)
    return 1 if failed else 0


def engine() -> Check:
    from primaplug.engine import build, ensure

    found = build.inspect_version(ensure.installed_version())
    if not found.ready:
        return Check("engine", "fail", found.problem,
                     "primaplug engine build (or make setup in a clone); docs/install.md")
    from primaplug.engine import cpu_kernels

    return Check("engine", "ok", f"llama-cpp-python {found.version} ({found.gpu or 'cpu'}), CPU kernels: "
                                 f"{cpu_kernels()}")


def memory() -> Check:
    from primaplug.device.memory import weights_budget
    from primaplug.memory.system import memory_view

    view = memory_view()
    mib = 1 << 20
    what = (f"{view.available_bytes / mib:.0f} MiB available of {view.total_bytes / mib:.0f} MiB ({view.source}); "
            f"a node's budget for weights, before its windows' cache and buffers: "
            f"{max(0, weights_budget(view, 0)) / mib:.0f} MiB (--memory-budget MiB sets it)")
    if view.available_bytes < MIN_NODE_BYTES:
        return Check("memory", "fail", what, f"a node needs at least {MIN_NODE_BYTES // mib} MiB available: close "
                                             "apps, or raise this device's (or container's) memory limit")
    return Check("memory", "ok", what)


def disk(folder: Path) -> Check:
    from primaplug.profiler import throughput
    from primaplug.store.copy import FREE_MARGIN_BYTES

    probe = folder if folder.exists() else next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    if free <= FREE_MARGIN_BYTES:
        return Check("disk", "fail", f"{folder}: {free >> 20} MiB free, and a node leaves "
                                     f"{FREE_MARGIN_BYTES >> 20} MiB free by default",
                     "free some space, or give the folder's room with primaplug node --disk-budget MiB")
    folder.mkdir(parents=True, exist_ok=True)
    size = min(DISK_TEST_BYTES, (free - FREE_MARGIN_BYTES) // 4)
    size -= size % (1 << 20)
    path = throughput.write_test_file(folder / f".doctor-{os.getpid()}.bin", size)
    try:
        speeds = throughput.disk_read_speeds(path)
    finally:
        path.unlink(missing_ok=True)
    return Check("disk", "ok", f"{folder}: {free / 2**30:.1f} GiB free; reads {speeds.seq_bps / 1e6:.0f} MB/s "
                               f"sequential, {speeds.rand_bps / 1e6:.0f} MB/s random (a slow disk streams less: "
                               f"docs/memory.md)")


def ports(listen: str) -> Check:
    from primaplug.transport import split_address

    host, port = split_address(listen)
    if port == 0:
        return Check("ports", "ok", f"{listen}: the node takes any two free ports")
    taken = []
    for p in (port, port + 1):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host if host not in ("*", "0.0.0.0") else "0.0.0.0", p))
            except OSError as e:
                taken.append(f"{p} ({e.strerror})")
    if taken:
        return Check("ports", "fail", f"{host}: cannot listen on {', '.join(taken)} (control {port}, ring {port + 1})",
                     "stop what listens there (another node?), or use primaplug node --listen HOST:OTHER_PORT "
                     "(HOST:0 for any free pair)")
    return Check("ports", "ok", f"{host}:{port} (control) and {port + 1} (ring) are free")


def keys(path: str | None, listen: str) -> Check:
    from primaplug.discovery import fingerprint
    from primaplug.transport import is_loopback, load_keys, split_address

    host, _ = split_address(listen)
    if path is None:
        if not is_loopback(host):
            return Check("cluster key", "fail", f"{listen} is off loopback and no --keys is given: the node would "
                                                "refuse to start", "primaplug keygen cluster.key once, copy it to "
                                                "every device, and pass --keys cluster.key")
        return Check("cluster key", "ok", "none given: loopback only, unencrypted (enough on one machine)")
    try:
        k = load_keys(path)
    except Exception as e:  # what load_keys says is the finding
        return Check("cluster key", "fail", f"{path}: {e}", "primaplug keygen cluster.key, and copy that file here")
    return Check("cluster key", "ok", f"{path} loads (fingerprint {fingerprint(k)}); every connection is encrypted "
                                      "with CurveZMQ")


def mdns() -> Check:
    from primaplug.discovery import self_test

    t0 = time.perf_counter()
    try:
        ok, ip = self_test()
    except Exception as e:  # no multicast, no interface: what zeroconf says
        return Check("mDNS", "warn", f"{type(e).__name__}: {e}",
                     "give heads this node's address with --nodes HOST:PORT (--nodes auto needs mDNS)")
    if not ok:
        return Check("mDNS", "warn", f"this device did not see its own announcement at {ip} within 3 s (multicast "
                                     "blocked by the network or a firewall?)",
                     "give heads this node's address with --nodes HOST:PORT (--nodes auto needs mDNS)")
    return Check("mDNS", "ok", f"announced at {ip} and seen in {time.perf_counter() - t0:.1f} s: --advertise and "
                               "--nodes auto work here")


def termux() -> list[Callable[[], Check]]:
    """On Termux: the wake lock a node takes with the screen off, and Android's battery optimisation."""
    from primaplug.memory.android import is_termux
    from primaplug.node.wakelock import LOCK, MISSING, find_command

    if not is_termux(os.environ):
        return []

    def wake_lock() -> Check:
        found = find_command(LOCK, os.environ)
        if found is None:
            return Check("wake lock", "warn", MISSING, "pkg install termux-tools")
        return Check("wake lock", "ok", f"{found}: a node holds it while it runs (--wake-lock auto)")

    def battery() -> Check:
        return Check("battery", "warn", "Android may stop Termux in the background to save battery, and the node "
                                        "with it; this cannot be read from Termux",
                     "Settings > Apps > Termux > Battery > Unrestricted (and keep Termux's notification)")

    return [wake_lock, battery]
