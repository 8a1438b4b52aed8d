"""A lower bound on time per token for one configuration of the emulated cluster (docs/memory.md, "The bound").

Per token, device i computes every layer of its windows once: W_i bytes of weights. What its memory cannot hold
must come from its disk again every token, so it reads at least max(0, W_i - M_i) bytes, M_i being what its
weights may use (the cap less the runtime's share: Device.memory_mib). Then:

- disk:    device i needs at least max(0, W_i - M_i) / disk_i seconds a token, whatever overlaps with what;
- compute: a token's layers run one after the other round the ring, W / compute seconds in all, on top of which it
           crosses every link once a round: k * (sum of one-way link latencies);
- bound = max(compute + links, max_i disk_i).

`compute` is plain llama-cpp-python's own decode rate on a model that fits, in seconds per byte of weights,
measured in the same run. The best any split could do (the disks' bound on the testbed, whatever the windows)
pools the disks: max(0, W - sum M_i) / sum disk_i.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.testbed.devices import Device

MiB = 1 << 20


@dataclass(frozen=True)
class Bound:
    tpot_s: float  # the bound
    compute_s: float  # the layers one after the other, plus the links
    disk_s: tuple[float, ...]  # per device
    read_bytes: tuple[int, ...]  # per device: what it must read a token at least

    def as_dict(self) -> dict[str, object]:
        return {"tpot_s": round(self.tpot_s, 3), "compute_s": round(self.compute_s, 3),
                "disk_s": [round(d, 3) for d in self.disk_s], "read_bytes": list(self.read_bytes)}


def tpot_bound(devices: list[Device], device_bytes: list[int], s_per_byte: float, rounds: int) -> Bound:
    """device_bytes: the weight bytes of each device's windows (all rounds)."""
    reads = tuple(max(0, w - int(d.memory_mib * MiB)) for d, w in zip(devices, device_bytes, strict=True))
    disk = tuple(r / d.read_bps for d, r in zip(devices, reads, strict=True))
    compute = sum(device_bytes) * s_per_byte + rounds * sum(d.link_latency_ms for d in devices) / 1e3
    return Bound(max(compute, *disk), compute, disk, reads)


def pooled_disk_bound(devices: list[Device], weight_bytes: int) -> float:
    """The disks' bound for any split: everything that no memory holds, read by all the disks together."""
    held = sum(int(d.memory_mib * MiB) for d in devices)
    return max(0, weight_bytes - held) / sum(d.read_bps for d in devices)
