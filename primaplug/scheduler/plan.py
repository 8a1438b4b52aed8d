"""A plan: which layers each device runs in each round, and what the latency model predicts for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from primaplug.core.profiles import ExpertBytes
from primaplug.core.windows import LayerRange, check_cover, execution_order, ring_windows
from primaplug.decoding import SpeculationEstimate
from primaplug.scheduler.latency import SET_NAMES, DeviceSet, Platform, assign_sets, predict
from primaplug.scheduler.ring import predict_ring
from primaplug.scheduler.rooms import Rooms, choose_rooms

GIB = 1024**3


@dataclass(frozen=True)
class DevicePlan:
    """One device's part of a plan: w layers per window (n of them on its GPU), one window per round."""

    name: str
    w: int
    n: int
    windows: tuple[LayerRange, ...]  # global [start, end) layer ranges, round 0 first
    device_set: DeviceSet
    ram_bytes: int
    vram_bytes: int
    disk_bytes: int  # re-read from disk per token
    compute_s: float
    memory_s: float
    disk_s: float
    network_s: float
    fault_s: float = 0.0  # ring model: the part of disk_s the token waits for (the rest overlaps other devices)
    room: int = 0  # ring model: layers of room when it streams layer by layer (scheduler/rooms.py; 0: its own rule)

    @property
    def total_s(self) -> float:
        """The device's busy time per token (ring model: its own time, the disk overlapping the others)."""
        return self.compute_s + self.memory_s + self.disk_s + self.network_s


@dataclass(frozen=True)
class DroppedDevice:
    """A device the scheduler left out of the ring, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class Fetch:
    """A node that lacks part of the model fetches it before the first token (primaplug/store): its missing bytes
    over its link."""

    device: str
    missing_bytes: int
    link_bps: float

    @property
    def seconds(self) -> float:
        return self.missing_bytes / self.link_bps if self.link_bps > 0 else float("inf")


def describe_fetches(fetches: Sequence[Fetch]) -> str:
    """What fetching adds before the first token: the slowest node's missing bytes over its link ("" for none)."""
    slowest = max((f for f in fetches if f.missing_bytes), key=lambda f: f.seconds, default=None)
    if slowest is None:
        return ""
    each = ", ".join(f"{f.device} {f.missing_bytes / 2**20:.0f} MiB" for f in fetches if f.missing_bytes)
    return (f"before the first token: {slowest.seconds:.1f} s more, to fetch what the nodes lack of the model over "
            f"their links ({each}; {slowest.device} the slowest, at {slowest.link_bps / 1e6:.1f} MB/s)")


@dataclass(frozen=True)
class Plan:
    """k rounds of windows over the devices in the ring; `devices[0]` is the head, which runs last in each round."""

    scheduler: str
    k: int
    n_layer: int
    devices: tuple[DevicePlan, ...]
    dropped: tuple[DroppedDevice, ...] = ()
    latency_model: str = "paper"  # "paper": Eq. 11, the sum over devices; "ring": scheduler/ring.py
    speculation: SpeculationEstimate | None = None  # with a draft on the head: whether drafting pays here
    experts: ExpertBytes | None = None  # a mixture of experts' layer as the plan priced it
    fetches: tuple[Fetch, ...] = ()  # nodes that fetch what they lack of the model before the first token
    rooms: Rooms | None = None  # ring model: the rooms chosen from the ring's timing, where they pay

    @property
    def head(self) -> DevicePlan:
        return self.devices[0]

    @property
    def ring(self) -> tuple[DevicePlan, ...]:
        """The devices in the order a token visits them in each round: the others as given, then the head."""
        return self.devices[1:] + self.devices[:1]

    def device(self, name: str) -> DevicePlan:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"no device {name!r} in the plan (devices: {', '.join(d.name for d in self.devices)})")

    def windows_in_order(self) -> list[tuple[str, LayerRange]]:
        """(device, window) in the order a token runs them: round by round round the ring."""
        return [(d.name, d.windows[r]) for r in range(self.k) for d in self.ring]

    @property
    def compute_s(self) -> float:
        return sum(d.compute_s for d in self.devices)

    @property
    def memory_s(self) -> float:
        return sum(d.memory_s for d in self.devices)

    @property
    def disk_s(self) -> float:
        return sum(d.disk_s for d in self.devices)

    @property
    def network_s(self) -> float:
        return sum(d.network_s for d in self.devices)

    @property
    def chain_s(self) -> float:
        """Ring model: what a token waits for, device after device (compute, memory, hops, faulting pages)."""
        return sum(d.compute_s + d.memory_s + d.network_s + d.fault_s for d in self.devices)

    @property
    def rooms_sent(self) -> Rooms | None:
        """The rooms the plan sends, if any node gets one (else every node keeps its own rule)."""
        return self.rooms if self.rooms is not None and any(self.rooms.rooms) else None

    @property
    def total_s(self) -> float:
        """Predicted time per token: the sum over devices (paper), or the longer of the chain and the busiest
        device's own time (ring); with rooms chosen from the ring's timing, the per-round model that chose them."""
        if self.rooms_sent is not None:
            return self.rooms_sent.tpot_s
        if self.latency_model == "ring":
            return max(self.chain_s, max(d.compute_s + d.memory_s + d.disk_s for d in self.devices))
        return sum(d.total_s for d in self.devices)

    def describe_rooms(self) -> str:
        """The rooms the plan sends ("" for none: every node keeps its own rule)."""
        if self.rooms_sent is None:
            return ""
        chosen = ", ".join(f"{d.name} {d.room}" for d in self.ring if d.room)
        return (f"rooms chosen from the ring's timing (layers read ahead beside the kept part of every layer, "
                f"streaming layer by layer): {chosen}; with each node's own rule {_ms(self.rooms_sent.own_rule_s)} "
                "ms/token")

    def describe(self) -> str:
        """A readable table of the plan (what `primaplug plan` prints)."""
        ring = " -> ".join(d.name for d in self.ring)
        rooms = self.rooms_sent
        lines = [
            f"plan by {self.scheduler}: {self.n_layer} layers, {self.k} round(s), {len(self.devices)} device(s); "
            f"ring: {ring} (head: {self.head.name})",
            f"predicted {_ms(self.total_s)} ms/token = compute {_ms(self.compute_s)} + memory {_ms(self.memory_s)}"
            f" + disk {_ms(self.disk_s)} + network {_ms(self.network_s)}" if self.latency_model == "paper" else
            f"predicted {_ms(self.total_s)} ms/token round by round (scheduler/rooms.py): each device's turn its "
            f"compute or the reading its room could not hold ahead, no disk reading for longer than a round"
            if rooms is not None else
            f"predicted {_ms(self.total_s)} ms/token (ring model): the longer of the token's path, "
            f"{_ms(self.chain_s)} ms (compute, memory, network, {_ms(sum(d.fault_s for d in self.devices))} of "
            f"pages faulting in), and the busiest device's own time, disk reads overlapping the others",
        ]
        header = ("device", "set", "w", "gpu", "windows", "RAM GiB", "VRAM GiB", "disk GiB/tok",
                  "compute ms", "memory ms", "disk ms", "net ms", "total ms")
        rows = [header]
        for d in self.ring:
            rows.append((d.name + (" (head)" if d is self.head else ""), d.device_set, str(d.w), str(d.n),
                         " ".join(str(r) for r in d.windows), _gib(d.ram_bytes), _gib(d.vram_bytes),
                         _gib(d.disk_bytes), _ms(d.compute_s), _ms(d.memory_s), _ms(d.disk_s), _ms(d.network_s),
                         _ms(d.total_s)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        left = {0, 1, 4}
        for r in rows:
            lines.append("  ".join(c.ljust(wd) if i in left else c.rjust(wd)
                                   for i, (c, wd) in enumerate(zip(r, widths, strict=True))).rstrip())
        lines += [f"dropped {d.name}: {d.reason}" for d in self.dropped]
        if rooms is not None:
            lines.append(self.describe_rooms())
        if self.speculation is not None:
            lines.append(self.speculation.describe())
        if fetching := describe_fetches(self.fetches):
            lines.append(fetching)
        return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}" if np.isfinite(s) else "inf"


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}" if b else "-"


def build_plan(
    p: Platform,
    k: int,
    w: Sequence[int] | np.ndarray,
    n: Sequence[int] | np.ndarray,
    scheduler: str,
    *,
    sets: Sequence[DeviceSet] | None = None,
    dropped: Sequence[DroppedDevice] = (),
    latency_model: str = "paper",
) -> Plan:
    """The plan for placement (k, w, n) on the devices of `p` (head first), with the model's prediction.

    `sets` are the device sets the scheduler planned with; by default each device's set follows its memory use.
    `latency_model` "ring" predicts with scheduler/ring.py, where the head may run no layer.
    """
    w = np.asarray(w, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    least = np.where(p.head & (latency_model == "ring"), 0, 1)
    if (w < least).any() or (n < 0).any() or (n > w).any():
        raise ValueError(f"a placement needs w >= 1 (the head w >= 0 in the ring model) and 0 <= n <= w on every "
                         f"device: w={w.tolist()} n={n.tolist()}")
    m = p.n_devices
    ring_index = list(range(1, m)) + [0]
    per_ring = ring_windows([int(w[i]) for i in ring_index], k, p.n_layer)
    windows: list[tuple[LayerRange, ...]] = [()] * m
    for pos, i in enumerate(ring_index):
        windows[i] = tuple(per_ring[pos])
    check_cover(execution_order(per_ring), p.n_layer)
    barred = sorted({r.start for r in execution_order(per_ring) if r.n_layers} & set(p.barred_starts))
    if barred:  # the ring model never plans these; the paper's sum and the baselines do not know them
        may = [il for il in range(p.n_layer) if il not in set(p.barred_starts)]
        raise ValueError(f"the {scheduler} placement starts a window at layer {barred[0]}, which attends to the keys "
                         "an earlier layer's indexer chose (GLM 5.2): windows start at layers with an indexer of "
                         f"their own ({', '.join(map(str, may[:6]))}{', ...' if len(may) > 6 else ''})")
    if sets is None:
        sets = tuple(SET_NAMES[s] for s in assign_sets(p, k, w, n))
    pred = predict(p, k, np.maximum(w, 1), n)  # memory use (the paper's) of a head with no layer: as with one
    rooms = None
    if latency_model == "ring":
        rooms = choose_rooms(p, k, w, n)
        ring = predict_ring(p, k, w, n)
        parts = [ring.compute_s, ring.memory_s, ring.disk_s, ring.network_s, ring.fault_s, ring.read_bytes]
    else:
        parts = [pred.compute_s, pred.memory_s, pred.disk_s, pred.network_s, np.zeros(m), pred.disk_bytes]
    compute, memory, disk, network, fault, read = parts
    devices = tuple(
        DevicePlan(
            name=p.names[i], w=int(w[i]), n=int(n[i]), windows=windows[i], device_set=sets[i],
            ram_bytes=int(pred.ram_bytes[i]), vram_bytes=int(pred.vram_bytes[i]), disk_bytes=int(read[i]),
            compute_s=float(compute[i]), memory_s=float(memory[i]), disk_s=float(disk[i]),
            network_s=float(network[i]), fault_s=float(fault[i]), room=rooms.rooms[i] if rooms else 0,
        )
        for i in range(m)
    )
    return Plan(scheduler=scheduler, k=k, n_layer=p.n_layer, devices=devices, dropped=tuple(dropped),
                latency_model=latency_model, experts=p.experts, rooms=rooms)
