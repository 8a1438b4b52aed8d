"""An emulated home cluster on one machine: real `primaplug node` processes, each in its own cgroup (memory
cap, disk read cap, CPU share) with its own copy of the model, and emulated Wi-Fi links between them.

    with Testbed(devices, model, workdir) as tb:
        llm = primaplug.Llama(model, nodes=tb.addresses, route=tb.route, ...)

The head is this process. Without a `head` device it is not capped (give it the output layer only); with one,
this process joins that device's cgroup while the testbed is up and reads its own model copy (`head_model`), so
the head is an emulated device like the others (the planner profiles it as one). Everything made here
(cgroups, the link proxy, node processes) is removed on exit, also on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

from benchmarks.testbed import cgroups
from benchmarks.testbed.devices import Device
from benchmarks.testbed.linkproxy import LinkProxy
from primaplug.head.launch import LocalNodes


def copy_model(model: Path, dest: Path) -> Path:
    """A copy of the model for one device (devices sharing a file would share its page cache); reused when the
    copy is already there and the same size."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists() or dest.stat().st_size != model.stat().st_size:
        tmp = dest.with_suffix(".tmp")
        shutil.copyfile(model, tmp)
        tmp.rename(dest)
    return dest


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so that everything the testbed made is removed."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"signal {signum}")


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind this process like Ctrl-C (finally blocks run, children are killed, cgroups go)."""
    signal.signal(signal.SIGTERM, _raise_terminated)

    pass


@contextlib.contextmanager
def testbed_script(name: str) -> Iterator[None]:
    """A benchmark script's testbed runs: SIGTERM unwinds like Ctrl-C, warnings only (llama.cpp's log quiet); a
    machine without cgroups, Ctrl-C or SIGTERM end the script with a line, status 2 or 130, once the testbed has
    removed what it made."""
    unwind_on_sigterm()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("primaplug.llama").setLevel(logging.ERROR)  # llama.cpp's own log
    try:
        yield
    except cgroups.CgroupUnavailableError as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, Terminated):
        print(f"{name}: interrupted; nodes stopped and cgroups removed", file=sys.stderr)
        raise SystemExit(130) from None


class Testbed:
    __test__ = False  # not a pytest class

    def __init__(self, devices: Sequence[Device], model: str | os.PathLike[str], workdir: str | os.PathLike[str], *,
                 node_args: Sequence[str] = (), head: Device | None = None, links: bool = True,
                 drop_caches: bool = True) -> None:
        self.devices, self.model, self.workdir = list(devices), Path(model), Path(workdir)
        self.node_args, self.links, self.drop = list(node_args), links, drop_caches
        self.head = head
        self.head_link = head or self.devices[-1]
        self.head_model = self.model
        self.head_group: cgroups.Cgroup | None = None
        self.groups: list[cgroups.Cgroup] = []
        self.proxy: LinkProxy | None = None
        self.nodes: LocalNodes | None = None
        self._old_term: object = None

    def _device_setup(self, group: cgroups.Cgroup, device: Device) -> Callable[[], None]:
        """In the node's process, before it starts: join the device's cgroup, and keep the repacked copy of its
        layers (engine/repacked.py) in a cache of its own, as its model copy is its own (no shared page cache)."""
        cache = str(self.workdir / device.name / "cache")

        def setup() -> None:
            group.preexec()
            os.environ["PRIMAPLUG_CACHE"] = cache

        return setup

    @property
    def addresses(self) -> list[str]:
        assert self.nodes is not None
        return self.nodes.addresses

    def route(self, sender: str, endpoint: str) -> str:
        """For Cluster: the link of `sender` (a node's control address, or "head") to `endpoint` goes through the
        proxy with that device's latency and bandwidth."""
        if not self.links or self.proxy is None or self.nodes is None:
            return endpoint
        by_address = {n.address: d for n, d in zip(self.nodes.nodes, self.devices, strict=True)}
        d = by_address.get(sender, self.head_link)
        return self.proxy.route(endpoint, d.link_latency_ms, d.link_mbit)

    def start(self) -> Testbed:
        cgroups.clean_stale()
        copies = [copy_model(self.model, self.workdir / d.name / self.model.name) for d in self.devices]
        disk = cgroups.block_device(copies[0])
        for d in self.devices:
            caps = cgroups.Caps(memory_bytes=d.cap_bytes, read_bps=d.read_bps, cpus=d.cpus)
            self.groups.append(cgroups.Cgroup(d.name, caps, disk).create())
        if self.head is not None:
            h = self.head
            self.head_model = copy_model(self.model, self.workdir / h.name / self.model.name)
            self.head_group = cgroups.Cgroup(h.name, cgroups.Caps(h.cap_bytes, h.read_bps, h.cpus), disk).create()
        if self.drop:
            cgroups.drop_caches()
        if self.links:
            self.proxy = LinkProxy()
        self.nodes = LocalNodes(copies, len(self.devices), log_dir=self.workdir / "logs", extra_args=self.node_args,
                                preexec=[self._device_setup(g, d) for g, d in zip(self.groups, self.devices,
                                                                                  strict=True)],
                                names=[d.name for d in self.devices])
        self.nodes.start()
        if self.head_group is not None:
            self.head_group.add(os.getpid())  # from here on this process is the head device
        return self

    def available_bytes(self) -> list[int]:
        """What each running node has for its model: its cap less what it uses besides page cache, as its own
        memory view counts it (primaplug/memory/system.py) and reports it to the planner."""
        return [d.cap_bytes - g.working_set_bytes() for d, g in zip(self.devices, self.groups, strict=True)]

    def peak_memory_bytes(self) -> list[int | None]:
        return [g.memory_peak_bytes() for g in self.groups]

    def stop(self) -> None:
        try:
            if self.nodes is not None:
                self.nodes.stop()
        finally:
            if self.proxy is not None:
                self.proxy.close()
            for g in [*self.groups, *([self.head_group] if self.head_group else [])]:
                g.remove()  # moves this process out of the head's group first
            self.nodes, self.proxy, self.groups, self.head_group = None, None, [], None

    def __enter__(self) -> Testbed:
        self._old_term = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            return self.start()
        except BaseException:
            self.stop()
            signal.signal(signal.SIGTERM, self._old_term)  # type: ignore[arg-type]
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGTERM, self._old_term)  # type: ignore[arg-type]
