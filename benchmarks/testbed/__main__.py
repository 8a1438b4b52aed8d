"""python -m benchmarks.testbed: bring an emulated home cluster up by hand, or clean up after one.

    sudo .venv/bin/python -m benchmarks.testbed up -m MODEL [--devices paper-d1-d4/24] [--no-links]
        starts one node per device (its own cgroup and model copy), prints each node's address and link, and
        runs until Ctrl-C or SIGTERM, then removes everything it made
    sudo .venv/bin/python -m benchmarks.testbed clean
        removes testbed cgroups an interrupted run left behind
    .venv/bin/python -m benchmarks.testbed devices [--devices ...]
        prints the devices a preset or file describes

The nodes' ring links go through the emulated Wi-Fi only for heads that route through this process's proxy
(benchmarks/memory_testbed.py does); a head started elsewhere reaches the nodes directly.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from benchmarks.testbed import cgroups
from benchmarks.testbed.cluster import Terminated
from benchmarks.testbed.devices import RUNTIME_MIB, load_devices


def _print_devices(source: str) -> None:
    for d in load_devices(source):
        cpus = f"{d.cpus:g} cores" if d.cpus else "no CPU cap"
        print(f"{d.name:<14} memory {d.memory_mib:7.0f} MiB (+{RUNTIME_MIB} runtime)  disk {d.disk_mbps:6.0f} MB/s  "
              f"link {d.link_latency_ms:g} ms {d.link_mbit:g} Mbit/s  {cpus}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.testbed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the emulated cluster until Ctrl-C")
    up.add_argument("-m", "--model", required=True)
    up.add_argument("--devices", default="paper-d1-d4/24")
    up.add_argument("--workdir", default=str(Path.home() / ".cache" / "primaplug" / "bench" / "testbed"))
    up.add_argument("--no-links", action="store_true", help="no emulated links")
    up.add_argument("node_args", nargs=argparse.REMAINDER, help="flags for every node, after --")
    sub.add_parser("clean", help="remove cgroups left by an interrupted run")
    dev = sub.add_parser("devices", help="print the devices of a preset or file")
    dev.add_argument("--devices", default="paper-d1-d4/24")
    a = ap.parse_args()

    if a.cmd == "devices":
        _print_devices(a.devices)
        return 0
    try:
        if a.cmd == "clean":
            removed = cgroups.clean_stale()
            print(f"removed {len(removed)} cgroup(s)" + "".join(f"\n  {d}" for d in removed))
            return 0
        from benchmarks.testbed.cluster import Testbed

        devices = load_devices(a.devices)
        extra = [x for x in a.node_args if x != "--"]
        with Testbed(devices, a.model, a.workdir, node_args=extra, links=not a.no_links) as tb:
            assert tb.nodes is not None
            for d, n in zip(devices, tb.nodes.nodes, strict=True):
                print(f"{d.name}: control {n.address}, ring {n.ring} (pid {n.pid}), cap {d.cap_bytes >> 20} MiB, "
                      f"disk {d.disk_mbps:g} MB/s", flush=True)
            print("primaplug run --nodes " + ",".join(tb.addresses) + f" -m {a.model}", flush=True)
            print("running; Ctrl-C stops the nodes and removes the cgroups", flush=True)
            signal.pause()
    except cgroups.CgroupUnavailableError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated):
        print("testbed: stopped, everything removed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
