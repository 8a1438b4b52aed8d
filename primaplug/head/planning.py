"""Plan a ring from measurements: profile the model and every device, measure the links, run the scheduler.

It joins the cluster, the profiler and the scheduler; used by `primaplug.Llama` and by `primaplug plan`. The head is
the scheduler's first device (the paper's m = 1); the nodes follow in ring order.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.decoding import estimate
from primaplug.engine import ModelLayout, read_layout
from primaplug.head.cluster import Cluster
from primaplug.head.events import Notice, Planned
from primaplug.profiler import compute_buffer_output_bytes, model_types, profile_device, profile_model
from primaplug.scheduler import DEFAULT_SLOW_DISK_BPS, Fetch, LatencyModel, Plan, Scheduler, solve

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
    head_reserved_bytes: int = 0  # memory the head keeps for itself, out of what the plan may use (a draft model)


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
    # every sequence in flight has a cache of n_ctx positions on every device, and a recurrent state with the
    # snapshots a draft rolls back to (n_rs_seq): the memory Halda places
    model = msgspec.structs.replace(model, n_kv=model.n_kv * s.n_parallel,
                                    state_bytes_layer=model.state_bytes_layer * s.n_parallel * (1 + s.n_rs_seq))
    say("profiling the nodes (measured once per device, then cached there)")
    nodes = cluster.profiles(force=settings.force_profile)
    say("profiling this device (the head)")
    head = profile_device(HEAD if HEAD not in {p.name for p in nodes} else f"{HEAD} (this device)",
                          model_types=model_types(model), cache_dir=settings.profile_dir,
                          force=settings.force_profile, model_path=Path(path), layer_bytes=model.layer_bytes)
    if settings.head_memory_bytes is not None:
        head = msgspec.structs.replace(head, mem_available_bytes=min(head.mem_available_bytes,
                                                                     settings.head_memory_bytes))
    if settings.head_reserved_bytes:
        head = msgspec.structs.replace(head, mem_available_bytes=max(0, head.mem_available_bytes
                                                                     - settings.head_reserved_bytes))
    say("measuring the ring's links")
    latency, bps = cluster.measure_links()
    devices = tuple(msgspec.structs.replace(p, link_latency_s=latency, link_bps=bps) for p in (head, *nodes))
    return Measured(model, devices, latency, bps)


def plan_cluster(cluster: Cluster, measured: Measured, settings: PlanSettings) -> Plan:
    """Solve for the measured cluster and give the cluster the plan's windows (dropped nodes leave it)."""
    plan = solve(measured.devices, measured.model, scheduler=settings.scheduler, rounds=settings.rounds,
                 slow_disk_bps=settings.slow_disk_bps, latency_model=settings.latency_model)
    cluster.apply_plan(plan, [d.name for d in measured.devices[1:]])
    links = {d.name: d.link_bps for d in measured.devices}
    fetches = tuple(Fetch(name, missing, links.get(name, measured.link_bps))
                    for name, missing in cluster.missing_bytes().items() if missing)
    plan = dataclasses.replace(plan, fetches=fetches)
    cluster.events.publish(Planned(plan.describe()))
    return plan


def draft_bytes(draft: object, n_ctx: int, n_batch: int, n_ubatch: int) -> int:
    """The memory a draft GGUF takes on the head: its weights, a KV cache of n_ctx positions and its buffers (0 for
    a draft that is not a GGUF file: a prompt lookup, a LlamaDraftModel, or a path that loading will refuse)."""
    if not isinstance(draft, (str, os.PathLike)) or not os.path.isfile(draft):
        return 0
    layout = read_layout(draft)
    kv = sum(layout.cache_bytes(il, n_ctx) for il in range(layout.n_layer))
    return os.path.getsize(draft) + kv + compute_buffer_output_bytes(layout, n_ctx, n_batch, n_ubatch)


def plan_with_speculation(plan: Plan, draft_token_s: float, n_min: int, n_max: int) -> Plan:
    """The plan with what speculation is expected to do on it: drafting costs draft_token_s a token on the head
    (counted in the head's time), a trip of one row takes the plan's predicted time per token, and each further
    row adds its compute only (the weights are read and every link crossed once per trip)."""
    return dataclasses.replace(plan, speculation=estimate(draft_token_s, plan.total_s, plan.compute_s, n_min, n_max))
