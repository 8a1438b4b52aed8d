"""Plan a ring from measurements: profile the model and every device, measure the links, run the scheduler.

It joins the cluster, the profiler and the scheduler; used by `primaplug.Llama` and by `primaplug plan`. The head is
the scheduler's first device (the paper's m = 1); the nodes follow in ring order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.engine import ModelLayout
from primaplug.head.cluster import Cluster
from primaplug.head.events import Notice, Planned
from primaplug.profiler import model_types, profile_device, profile_model
from primaplug.scheduler import DEFAULT_SLOW_DISK_BPS, LatencyModel, Plan, Scheduler, solve

HEAD = "head"


@dataclass(frozen=True)
class PlanSettings:
    scheduler: Scheduler = "halda"
    rounds: int | None = None  # None: the scheduler picks k
    slow_disk_bps: float = DEFAULT_SLOW_DISK_BPS  # disks at most this fast never stream layers (Halda)
    latency_model: LatencyModel = "ring"  # what Halda minimises and plans are scored by (docs/halda.md)
    profile_dir: str | None = None  # the head's profile cache (default ~/.cache/primaplug/profiles)
    force_profile: bool = False  # measure every device again
    # the memory the head lends the model, as the scheduler sees it (None: what its OS says is available); a head
    # that must leave room for the apps its user runs gives less, and the plan puts more on the nodes
    head_memory_bytes: int | None = None


@dataclass(frozen=True)
class Measured:
    model: ModelProfile
    devices: tuple[DeviceProfile, ...]  # the head first, then the nodes in ring order
    link_latency_s: float
    link_bps: float


def measure(cluster: Cluster, path: str | os.PathLike[str], layout: ModelLayout, settings: PlanSettings) -> Measured:
    """Profile the model, the head and every node of a connected cluster, and the ring's links."""
    s, say = cluster.settings, lambda what: cluster.events.publish(Notice(what))
    model = profile_model(layout, n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch)
    say("profiling the nodes (measured once per device, then cached there)")
    nodes = cluster.profiles(force=settings.force_profile)
    say("profiling this device (the head)")
    head = profile_device(HEAD if HEAD not in {p.name for p in nodes} else f"{HEAD} (this device)",
                          model_types=model_types(model), cache_dir=settings.profile_dir,
                          force=settings.force_profile, model_path=Path(path), layer_bytes=model.layer_bytes)
    if settings.head_memory_bytes is not None:
        head = msgspec.structs.replace(head, mem_available_bytes=min(head.mem_available_bytes,
                                                                     settings.head_memory_bytes))
    say("measuring the ring's links")
    latency, bps = cluster.measure_links()
    devices = tuple(msgspec.structs.replace(p, link_latency_s=latency, link_bps=bps) for p in (head, *nodes))
    return Measured(model, devices, latency, bps)


def plan_cluster(cluster: Cluster, measured: Measured, settings: PlanSettings) -> Plan:
    """Solve for the measured cluster and give the cluster the plan's windows (dropped nodes leave it)."""
    plan = solve(measured.devices, measured.model, scheduler=settings.scheduler, rounds=settings.rounds,
                 slow_disk_bps=settings.slow_disk_bps, latency_model=settings.latency_model)
    cluster.apply_plan(plan, [d.name for d in measured.devices[1:]])
    cluster.events.publish(Planned(plan.describe()))
    return plan
