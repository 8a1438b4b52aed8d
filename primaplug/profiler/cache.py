"""The device profile's measured speeds, cached as JSON on the device and keyed by what they depend on.

Speeds depend on the hardware, the OS and kernel, the engine build, the cgroup the process runs in (emulated
devices on one machine differ only by their cgroups' caps) and the disk that was read. A change in any of these
gives another key and so a fresh measurement; memory availability is never cached.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec

from primaplug.core.settings import cache_root

# bump when a measurement method changes: every cached profile is then measured again
PROFILER_VERSION = 1


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    cpu_model: str
    cpu_count: int
    mem_total_bytes: int  # physical memory
    os: str
    kernel: str
    machine: str
    engine: str  # llama-cpp-python's version, with primaplug's patch key
    backend: str
    cgroup: str
    disk: str  # the device the disk figures were read from
    profiler: int = PROFILER_VERSION

    def key(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:20]


class Measured(msgspec.Struct, kw_only=True):
    """What profiling measured on one device (everything in a DeviceProfile that does not change minute by
    minute)."""

    fingerprint: Fingerprint
    cpu_flops: dict[str, float]
    gpu_flops: dict[str, float] = msgspec.field(default_factory=dict)
    cpu_read_bps: float = 0.0
    kv_copy_cpu_bps: float = 0.0
    gpu_read_bps: float = 0.0
    kv_copy_gpu_bps: float = 0.0
    h2d_bps: float = 0.0
    d2h_bps: float = 0.0
    copy_latency_s: float = 0.0
    disk_seq_bps: float = 0.0
    disk_rand_bps: float = 0.0
    disk_cache_bypassed: bool = True
    metal_working_set_bytes: int = 0  # as llama.cpp logged it when it opened Metal; 0 when not seen
    measured_at: float = 0.0  # Unix time
    seconds: float = 0.0  # how long measuring took


def default_cache_dir() -> Path:
    return cache_root() / "profiles"


def cache_path(cache_dir: Path, fingerprint: Fingerprint) -> Path:
    return cache_dir / f"device-{fingerprint.key()}.json"


def load(cache_dir: Path, fingerprint: Fingerprint) -> Measured | None:
    """The cached measurement for this fingerprint, or None (none yet, unreadable, or of another fingerprint)."""
    try:
        measured = msgspec.json.decode(cache_path(cache_dir, fingerprint).read_bytes(), type=Measured)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return measured if measured.fingerprint == fingerprint else None


def save(cache_dir: Path, measured: Measured) -> Path:
    """Write atomically (a reader never sees half a file)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_path(cache_dir, measured.fingerprint)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(measured)))
    os.replace(tmp, path)
    return path
