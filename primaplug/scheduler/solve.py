"""The scheduler's entry point: a plan for a model on a list of devices, by Halda or by a baseline."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from primaplug.core.errors import PlacementInfeasibleError, no_gpu_backend
from primaplug.core.profiles import DeviceProfile, ModelProfile
from primaplug.scheduler.baselines import compute_proportional, memory_proportional
from primaplug.scheduler.halda import HaldaResult, Solution, gpu_layer_cap, halda, valid_rounds
from primaplug.scheduler.latency import DEFAULT_SLOW_DISK_BPS, Platform, no_spill_capacity, platform
from primaplug.scheduler.plan import GIB, DroppedDevice, Plan, build_plan
from primaplug.scheduler.ring import best_placement
from primaplug.scheduler.rooms import choose_rooms

Scheduler = Literal["halda", "memory", "compute"]
SCHEDULERS: tuple[Scheduler, ...] = ("halda", "memory", "compute")
LatencyModel = Literal["ring", "paper"]
LATENCY_MODELS: tuple[LatencyModel, ...] = ("ring", "paper")

_ADVICE = ("add a device with free RAM/VRAM or a fast SSD, plan for a shorter context (a smaller n_kv), "
           "or use a smaller quantization of the model")


def solve(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    *,
    scheduler: Scheduler = "halda",
    rounds: int | None = None,
    slow_disk_bps: float = DEFAULT_SLOW_DISK_BPS,
    latency_model: LatencyModel = "paper",
) -> Plan:
    """Plan `model` on `devices` (`devices[0]` is the head; the others run in the given order in each round).

    `scheduler`: "halda" (the paper's Algorithm 1 with device selection), "memory" (layers in proportion to
    memory, exo's rule) or "compute" (in proportion to compute speed with OOM migration, Galaxy's rule).
    `rounds` fixes k for Halda (a divisor of the layer count); by default Halda picks it (in the paper's
    model k = 1 is never slower, docs/halda.md; the ring's model picks k > 1 where prefetch overlap pays).
    Devices whose disk reads at most `slow_disk_bps` bytes/s never spill layers to disk under Halda.
    `latency_model` "paper" is Eq. 11 (the sum over devices), minimised by the ILP; "ring" is
    scheduler/ring.py (disks overlapping the other devices' work, as the nodes' prefetcher runs), minimised
    exactly by ring.best_placement. Both scores any scheduler's plan; the head uses "ring".
    Raises PlacementInfeasibleError when the model cannot be placed, ValueError on malformed input.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    if latency_model not in LATENCY_MODELS:
        raise ValueError(f"unknown latency model {latency_model!r}; choose one of {', '.join(LATENCY_MODELS)}")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be unique: {names}")
    if model.n_layer < 1 or model.layer_bytes_with_kv <= 0:
        raise ValueError(f"model {model.name!r} needs at least one layer of positive size")
    if rounds is not None and (rounds < 1 or model.n_layer % rounds):
        raise ValueError(f"rounds must divide the model's {model.n_layer} layers, got {rounds}")
    if rounds not in (None, 1) and scheduler != "halda":
        raise ValueError(f"the {scheduler} scheduler plans one round; only halda takes rounds={rounds}")
    if model.barred_starts and (scheduler != "halda" or latency_model != "ring"):
        raise PlacementInfeasibleError(
            f"{model.name}'s windows may not start at layers {', '.join(map(str, model.barred_starts[:6]))}... "
            f"(they share an earlier layer's indexer, GLM 5.2), which only Halda under the ring's latency model plans "
            f"for", advice="plan with scheduler='halda' and latency_model='ring' (the head's default), or split by "
                           "hand")
    p = platform(devices, model, slow_disk_bps=slow_disk_bps)
    _check_capacity(p, slow_disk_bps)
    if scheduler == "halda":
        return _solve_halda(p, slow_disk_bps, rounds, latency_model)
    if p.n_devices > p.n_layer:
        raise PlacementInfeasibleError(
            f"{p.n_devices} devices but only {p.n_layer} layers: the {scheduler} scheduler gives every device a layer",
            advice="pass fewer devices, or use scheduler='halda', which drops devices")
    w, n = memory_proportional(p) if scheduler == "memory" else compute_proportional(p)
    return build_plan(p, 1, w, n, scheduler, latency_model=latency_model)


def _check_capacity(p: Platform, slow_disk_bps: float) -> None:
    """Raise when no device may spill to disk and the devices' free memory cannot hold every layer."""
    if not p.slow_disk.all():
        return
    held = int(no_spill_capacity(p).sum())
    if held >= p.n_layer:
        return
    short = (p.n_layer - held) * p.layer_kv_bytes
    raise PlacementInfeasibleError(
        f"the model needs {p.n_layer} layers of {p.layer_kv_bytes / GIB:.2f} GiB (weights and KV cache), the "
        f"devices' free RAM and VRAM hold {held} of them ({short / GIB:.2f} GiB short), and no device has a disk "
        f"faster than {slow_disk_bps / 1e6:.0f} MB/s to stream the rest from",
        shortfall_bytes=short, advice=_ADVICE)


def _layer_time(p: Platform) -> np.ndarray:
    return p.alpha + np.minimum(p.beta, 0.0)


def _solve_halda(p: Platform, slow_disk_bps: float, rounds: int | None, latency_model: LatencyModel) -> Plan:
    dropped: list[DroppedDevice] = []
    held = no_spill_capacity(p)
    if p.slow_disk[0] and held[0] < 1:
        short = int(p.ram_fixed(1)[0] + p.layer_kv_bytes - p.ram_cap[0])
        raise PlacementInfeasibleError(
            f"the head {p.names[0]!r} cannot hold one layer ({p.layer_kv_bytes / GIB:.2f} GiB) besides the input "
            f"row, the output layer and its compute buffer in its free memory, and its disk is slower than "
            f"{slow_disk_bps / 1e6:.0f} MB/s", shortfall_bytes=max(short, 1),
            advice="choose another device as the head, or " + _ADVICE)
    active = [0]
    for i in range(1, p.n_devices):
        if p.slow_disk[i] and held[i] < 1:
            dropped.append(DroppedDevice(p.names[i], "its free memory does not hold one layer and its disk is too "
                                                     "slow to stream layers from"))
        else:
            active.append(i)
    per_round = p.n_layer // (rounds or 1)
    if len(active) > per_round:
        # every device in the ring holds at least one layer per round: keep the fastest (the head always)
        order = sorted(active[1:], key=lambda i: _layer_time(p)[i])
        for i in order[per_round - 1:]:
            dropped.append(DroppedDevice(p.names[i], f"more devices than the {per_round} layers per round; "
                                                     "it is among the slowest"))
        active = [0] + sorted(order[: per_round - 1])
    ks = None if rounds is None else [rounds]
    solver = _ring_halda if latency_model == "ring" else halda
    result = solver(p.subset(active), rounds=ks)
    if result is None:
        which = f"k = {rounds}" if rounds else f"any number of rounds k (a divisor of {p.n_layer})"
        raise PlacementInfeasibleError(
            f"no placement with {which} keeps every device with a slow disk within its free memory",
            advice=_ADVICE)
    # device selection (appendix A.7): drop devices that hold at most one layer per window, re-solve, repeat
    while True:
        low = [active[j] for j in range(1, len(active)) if result.solution.w[j] <= 1]
        if not low:
            break
        keep = [i for i in active if i not in low]
        trial: HaldaResult | None = solver(p.subset(keep), rounds=ks)
        if trial is None or trial.solution.objective_s > result.solution.objective_s:
            break  # the smaller ring is slower (or impossible): these devices help, keep them
        for i in low:
            dropped.append(DroppedDevice(
                p.names[i], f"held {result.solution.w[active.index(i)]} layer per window; without it the predicted "
                f"time is {trial.solution.objective_s * 1e3:.1f} ms/token instead of "
                f"{result.solution.objective_s * 1e3:.1f}"))
        active, result = keep, trial
    if latency_model == "ring" and len(active) > 1:
        # the ring model lets the head hand all its layers to a node, which the rule above never drops: the
        # ring must also beat the head alone
        alone = solver(p.subset([0]), rounds=ks)
        if alone is not None and alone.solution.objective_s < result.solution.objective_s:
            for i in active[1:]:
                dropped.append(DroppedDevice(
                    p.names[i], f"the head alone is predicted at {alone.solution.objective_s * 1e3:.1f} ms/token, "
                    f"the ring at {result.solution.objective_s * 1e3:.1f}"))
            active, result = [0], alone
    s = result.solution
    sets = result.sets if latency_model == "paper" else None
    return build_plan(p.subset(active), s.k, s.w, s.n, "halda", sets=sets, dropped=dropped,
                      latency_model=latency_model)


def _ring_halda(p: Platform, rounds: Sequence[int] | None = None) -> HaldaResult | None:
    """The ring model's optimum over every k (or the given ones), in the shape Halda's answer takes. Each k's
    placement is priced with the rooms its streaming devices would get (scheduler/rooms.py), where they pay."""
    best: Solution | None = None
    for k in rounds or valid_rounds(p.n_layer, p.n_devices):
        found = best_placement(p, k)
        if found is None:
            continue
        rooms = choose_rooms(p, k, found.w, found.n)
        if any(rooms.rooms):
            found = dataclasses.replace(found, objective_s=rooms.tpot_s)
        if best is None or found.objective_s < best.objective_s:
            best = found
    if best is None:
        return None
    return HaldaResult(best, sets=(), iterations=0, forced=())


def placement(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    sizes: Sequence[int],
    *,
    rounds: int = 1,
    gpu_layers: Sequence[int] = (),
    scheduler: str = "manual",
    slow_disk_bps: float = DEFAULT_SLOW_DISK_BPS,
    latency_model: LatencyModel = "ring",
) -> Plan:
    """The plan of a split chosen by hand, scored by the latency model: `sizes` are the layers per round of each
    node in ring order (`devices[1:]`), then optionally the head's (`devices[0]`; left out, it runs only the output
    layer); `gpu_layers` the GPU layers of each node's windows. Raises ValueError saying what does not fit."""
    nodes = len(devices) - 1
    if len(sizes) not in (nodes, nodes + 1):
        raise ValueError(f"give one window size per node ({nodes}), then optionally the head's; got {len(sizes)}")
    if rounds < 1 or model.n_layer % rounds:
        raise ValueError(f"the rounds must divide the model's {model.n_layer} layers, got {rounds}")
    if sum(sizes) * rounds != model.n_layer:
        raise ValueError(f"{' + '.join(map(str, sizes))} layers per round over {rounds} round(s) run "
                         f"{sum(sizes) * rounds} layers; the model has {model.n_layer}")
    if any(s < 1 for s in sizes[:nodes]):
        raise ValueError("every node needs at least one layer per round (leave a node out of the ring instead)")
    head = sizes[nodes] if len(sizes) > nodes else 0
    last = head or sizes[nodes - 1] if nodes else head
    if last < model.tail_layers:
        raise ValueError(f"the last {model.tail_layers} layers share keys and values and must run in one window, the "
                         f"last of the ring: give the last device ({'the head' if head else 'the last node'}) at least "
                         f"{model.tail_layers} layers a round, not {last}")
    w = [head, *sizes[:nodes]]
    gpu = [0] + [min(gpu_layers[i] if i < len(gpu_layers) else 0, w[i + 1]) for i in range(nodes)]
    p = platform(devices, model, slow_disk_bps=slow_disk_bps)
    return build_plan(p, rounds, w, gpu, scheduler, latency_model=latency_model)


def check_gpu_layers(devices: Sequence[DeviceProfile], model: ModelProfile, sizes: Sequence[int],
                     gpu_layers: Sequence[int], *, rounds: int = 1) -> None:
    """Raise ValueError when a split by hand asks a node for GPU layers (`gpu_layers`, of each of its windows of
    `sizes` layers; nodes are `devices[1:]`) that its profile says it cannot hold: no GPU backend, or not that many
    layers in its free VRAM with `rounds` windows. placement() scores such a split anyway (as drawn); a node would
    refuse it (no GPU backend) or fail to load it (out of VRAM). Halda and the baselines never ask for more."""
    p = platform(devices, model)
    cap = gpu_layer_cap(p, rounds)
    for i, d in enumerate(devices[1:], start=1):
        n = min(gpu_layers[i - 1] if i - 1 < len(gpu_layers) else 0, sizes[i - 1] if i - 1 < len(sizes) else 0)
        if n <= 0:
            continue
        if d.backend == "cpu":
            raise ValueError(no_gpu_backend(f"{d.name}'s engine"))
        if not p.gpu[i]:
            raise ValueError(f"{d.name}'s {d.backend} backend cannot run layers on {d.os}: plan without GPU layers "
                             "(-ngl 0)")
        if n > cap[i]:
            free = p.vram_cap[i] / GIB
            raise ValueError(
                f"{d.name}'s GPU holds {int(cap[i])} of its layers per window with {rounds} round(s), not {n}: "
                f"{free:.2f} GiB free, {p.layer_kv_bytes / GIB:.2f} GiB a layer with its KV cache, "
                f"{p.vram_window[i] / GIB:.2f} GiB of compute buffer a window: lower -ngl to {int(cap[i])}")


def alternatives(
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    *,
    scheduler: Scheduler = "halda",
    slow_disk_bps: float = DEFAULT_SLOW_DISK_BPS,
    latency_model: LatencyModel = "ring",
) -> list[tuple[int, Plan | str]]:
    """What the scheduler would plan with each number of rounds k (a divisor of the layer count): the plan, or why
    there is none. The baselines plan one round only."""
    ks = [k for k in range(1, model.n_layer + 1) if model.n_layer % k == 0 and (k < model.n_layer or k == 1)]
    out: list[tuple[int, Plan | str]] = []
    for k in ks if scheduler == "halda" else [1]:
        try:
            out.append((k, solve(devices, model, scheduler=scheduler, rounds=k, slow_disk_bps=slow_disk_bps,
                                 latency_model=latency_model)))
        except (PlacementInfeasibleError, ValueError) as e:
            out.append((k, str(e)))
    return out
