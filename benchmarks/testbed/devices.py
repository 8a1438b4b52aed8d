"""Emulated devices: what each one may use (memory, disk reads, CPU, its link to the next device in the ring).

A device file is TOML, one table per device in ring order:

    [[device]]
    name = "d1-mac"
    memory_mib = 150        # what the model may use; the runtime's own memory is added on top (see RUNTIME_MIB)
    disk_mbps = 45          # disk reads, MB/s (page faults of mmaps included)
    link_latency_ms = 5     # one way, to the next device in the ring
    link_mbit = 450
    cpus = 1.0              # CPU time, in cores (omit for no cap)

Presets are the prima.cpp paper's testbed (its Table 3, devices D1-D4), scaled down so that a synthetic model of
a few GB plays the part of Llama-3-70B (40 GB): memory and disk speed are divided by the same factor.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

MiB = 1 << 20
# memory a node process needs before any weight (Python, numpy, zmq, llama.cpp: about 40 MiB measured idle); added to
# each device's cap so that memory_mib is what its model data may use (measured: docs/memory.md)
RUNTIME_MIB = 64


@dataclass(frozen=True)
class Device:
    name: str
    memory_mib: float
    disk_mbps: float
    link_latency_ms: float = 5.0
    link_mbit: float = 450.0
    cpus: float | None = None

    @property
    def cap_bytes(self) -> int:
        return int((self.memory_mib + RUNTIME_MIB) * MiB)

    @property
    def read_bps(self) -> int:
        return int(self.disk_mbps * 1e6)


# D1 Mac M1 (2.4 GiB free, 0.7 GB/s), D2 laptop (4.1 GiB, 3 GB/s), D3 desktop (9.7 GiB, 3 GB/s),
# D4 phone under Termux (1.9 GiB, 1.4 GB/s); Wi-Fi links of 3-7 ms and 320-610 Mbit/s
PAPER_D1_D4 = (
    Device("d1-mac", 2.4 * 1024, 700, 5, 450),
    Device("d2-laptop", 4.1 * 1024, 3000, 3, 610),
    Device("d3-desktop", 9.7 * 1024, 3000, 4, 610),
    Device("d4-phone", 1.9 * 1024, 1400, 7, 320),
)

# the same with CPU shares (cores of this machine) in the order of the paper's CPUs: M1, i9 laptop, i9 desktop,
# Kirin phone, for heterogeneous compute
PAPER_D1_D4_CPU = tuple(replace(d, cpus=c) for d, c in zip(PAPER_D1_D4, (1.0, 1.5, 2.0, 0.5), strict=True))

PRESETS = {"paper-d1-d4": PAPER_D1_D4, "paper-d1-d4-cpu": PAPER_D1_D4_CPU}


def scaled(devices: tuple[Device, ...] | list[Device], factor: float) -> list[Device]:
    """Divide every device's memory and disk speed by `factor` (links and CPU are left as they are)."""
    return [replace(d, memory_mib=d.memory_mib / factor, disk_mbps=d.disk_mbps / factor) for d in devices]


def load_devices(source: str) -> list[Device]:
    """A preset name (optionally `name/FACTOR`, scaled down by FACTOR) or a TOML device file."""
    name, _, factor = source.partition("/")
    if name in PRESETS:
        return scaled(PRESETS[name], float(factor or 1))
    path = Path(source)
    if not path.exists():
        raise SystemExit(f"no device file {source} and no preset of that name (presets: {', '.join(PRESETS)})")
    data = tomllib.loads(path.read_text())
    try:
        return [Device(**d) for d in data["device"]]
    except (KeyError, TypeError) as e:
        raise SystemExit(f"{source}: every [[device]] needs name, memory_mib and disk_mbps ({e})") from None
