"""The ring's latency model: time per token when the nodes stream windows with this prefetcher, and its optimum.

The paper's model (latency.py, Eq. 11) adds up every device's compute, memory, disk and network time. On the ring
the nodes run, a device reads its next window from disk while the other devices compute, so disks work side by
side: on the emulated cluster, splitting the same streamed layers over two disks ran 1.3x faster than piling them
on one, which Eq. 11 scores the same (docs/halda.md). Here, with k rounds:

    T = max(chain, max_m own_m)
    chain  = sum_m compute_m + memory_m + network_m + faults_m / s_m    what a token waits for, device after device
    own_m  = compute_m + memory_m + reads_m / s_m                       device m's own busy time per token

`reads_m` is everything device m reads from disk per token and `faults_m` the part of it that cannot be prefetched
(a window's streamed part beyond the prefetch room), both in closed form from the node's prefetch policy
(memory/policy.py, `plan_prefetch`): a device whose windows fit reads nothing; otherwise it keeps a fraction of
every layer, streams the rest, and prefetches the next window while the others compute. Metal devices keep the
paper's rule (the whole share re-read each token, on the token's path), as the prefetcher does not manage Metal's
buffers. Compute, memory access and network times are the paper's (latency.py's Platform).

`best_placement` finds the exact optimum over (w, n) for one k: for a bound t on every device's own time, a
dynamic program over devices gives the least chain; the answer is the smallest max(t, chain(t)) over the bounds
the devices' own times can take, found by bisection because chain(t) never grows with t.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from primaplug.core.budget import EXPERT_WORKING_LAYERS, MARGIN, MAX_KEEP, ROOM_SLACK, ROOM_SLACK_SHARE
from primaplug.scheduler.halda import Solution, gpu_layer_cap
from primaplug.scheduler.latency import MACOS_METAL, Platform


def stream_bytes(budget: np.ndarray, window: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(read, faulted) bytes per token of a device with k windows of `window` streamable bytes each and `budget`
    bytes for weights, as `plan_prefetch` plans them (page rounding aside). Vectorised."""
    budget = np.asarray(budget, dtype=float)
    window = np.asarray(window, dtype=float)
    total = k * window
    fits = total <= budget
    early = budget >= 2 * window  # two windows fit at once: the next is prefetched while the current computes
    slots = np.where(early, 2.0, 1.0)
    room0, need = budget - slots * window, total - slots * window
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where((need > 0) & (room0 > 0), np.clip(room0 / np.where(need > 0, need, 1.0), 0.0, MAX_KEEP), 0.0)
        slack = np.minimum(ROOM_SLACK, budget / ROOM_SLACK_SHARE)  # core/budget.py: room_slack, vectorised
        f = np.minimum(f, np.maximum(0.0, (budget - slack) / total))
    kept = f * total
    streamed = (1 - f) * window  # per window
    room = np.maximum(0.0, np.where(early, (budget - kept) / 2, budget - kept))
    faulted = streamed - np.minimum(streamed, room)
    return np.where(fits, 0.0, k * streamed), np.where(fits, 0.0, k * faulted)


def _routed_experts(p: Platform, k: int, lc: np.ndarray, budget: np.ndarray, read: np.ndarray,
                    faulted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A mixture of experts whose windows do not fit reads only its tokens' routed experts (memory/experts.py,
    device/memory.py: _plan_experts): the rest of its layers streams as any window, within the budget less a
    working set; the experts a token chooses are read as it computes (on the token's path) unless the hot set,
    which holds what the rest leaves of the budget, has them. Routing is taken as uniform: the hot set holds each
    chosen expert with the share of the experts it holds."""
    rest = p.layer_bytes - p.expert_bytes
    working = EXPERT_WORKING_LAYERS * p.expert_share * p.expert_bytes
    rest_read, rest_faulted = stream_bytes(budget - working, lc / k * rest, k)
    rest_used = np.where(lc * rest <= budget - working, lc * rest, budget - working)
    all_experts = lc * p.expert_bytes
    with np.errstate(divide="ignore", invalid="ignore"):
        hit = np.clip(np.maximum(working, budget - rest_used) / np.where(all_experts > 0, all_experts, 1.0), 0, 1)
    chosen = lc * p.expert_share * p.expert_bytes * (1 - hit)
    streams = read > 0
    return np.where(streams, rest_read + chosen, read), np.where(streams, rest_faulted + chosen, faulted)


@dataclass(frozen=True, eq=False)
class RingPrediction:
    """The ring model's answer for one placement (or many: leading axes), per device on the last axis."""

    compute_s: np.ndarray
    memory_s: np.ndarray
    network_s: np.ndarray
    disk_s: np.ndarray  # reads per token / s^disk: the device's disk busy time, overlapped with the others
    fault_s: np.ndarray  # the part of it the token waits for (pages that fault in during compute)
    read_bytes: np.ndarray

    @property
    def chain_s(self) -> np.ndarray:
        return (self.compute_s + self.memory_s + self.network_s + self.fault_s).sum(axis=-1)

    @property
    def own_s(self) -> np.ndarray:
        return self.compute_s + self.memory_s + self.disk_s

    @property
    def total_s(self) -> np.ndarray:
        return np.maximum(self.chain_s, self.own_s.max(axis=-1))


def weights_budget(p: Platform, k: int, lc: np.ndarray) -> np.ndarray:
    """What each device's memory leaves for the weights of its `lc` CPU layers a token, as a node's budget counts it
    (device/memory.py): its cap, less its fixed part, those layers' KV cache and the margin."""
    return p.ram_cap - p.ram_fixed(k) - lc * (p.layer_kv_bytes - p.layer_bytes) - MARGIN * p.ram_total


def predict_ring(p: Platform, k: int, w: np.ndarray | Sequence[int], n: np.ndarray | Sequence[int]) -> RingPrediction:
    """The ring model for placements (k, w, n); the head is always in the ring (it embeds, runs the output layer
    and samples), other devices with w = 0 are not. Every device in a ring of two or more sends each round's
    hidden state on (the head to the first node); a head alone sends nothing."""
    w = np.asarray(w, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    lg = k * n
    lc = k * w - lg
    in_ring = (w > 0) | p.head
    compute = lc * p.t_cpu + lg * p.t_gpu + p.head * p.t_out
    memory = lc * p.m_cpu + lg * p.m_gpu + k * (w > 0) * p.copy + p.head * p.m_head
    network = k * in_ring * p.comm * (p.n_devices > 1)  # a head alone passes nothing on
    metal = p.kind == MACOS_METAL
    budget = weights_budget(p, k, lc)
    read, faulted = stream_bytes(np.where(in_ring, budget, np.inf), lc / k * p.layer_bytes, k)
    if p.expert_bytes and p.expert_share:
        read, faulted = _routed_experts(p, k, lc, np.where(in_ring, budget, np.inf), read, faulted)
    # Metal: the paper's Eq. 16, whole share re-read on the token's path once unified memory runs out
    share = k * w * p.layer_kv_bytes + p.ram_fixed(k)
    metal_read = np.where(in_ring & (share > p.ram_cap), k * w * p.layer_bytes + p.head * p.head_extra, 0.0)
    read = np.where(metal, metal_read, read)
    faulted = np.where(metal, metal_read, faulted)
    faulted = faulted + np.where(p.head & (read == 0), p.lookup_bytes, 0)  # the head's input row, each token
    # slow disks never stream (Halda's rule), unmeasured disks cannot be priced
    barred = (read > 0) & (p.slow_disk | (p.disk_bps <= 0))
    s = np.where(p.disk_bps > 0, p.disk_bps, 1.0)
    disk = np.where(barred, np.inf, read / s)
    fault = np.where(barred, np.inf, np.where(p.disk_bps > 0, faulted / s, 0.0))
    return RingPrediction(compute_s=compute, memory_s=memory, network_s=network, disk_s=disk, fault_s=fault,
                          read_bytes=read)


def gpu_layers(p: Platform, k: int, w: np.ndarray) -> np.ndarray:
    """GPU layers per window for w layers per window: as many as VRAM holds where the GPU is the faster."""
    faster = p.gpu & (p.t_gpu + p.m_gpu < p.t_cpu + p.m_cpu)
    return np.where(faster, np.minimum(w, gpu_layer_cap(p, k)), 0)


def best_placement(p: Platform, k: int, beat: float = np.inf, *, relays: bool = False) -> Solution | None:
    """The placement with k rounds that minimises the ring model (every device but the head runs at least one
    layer per window, unless `relays`; the head may run none); None when none is finite or none is faster than
    `beat`. A relay (no layer) still passes the hidden state on, but its hop is not counted."""
    per_round = p.n_layer // k
    allowed = p.boundaries_allowed(k)  # where a window may end (GLM 5.2: not before a layer sharing an indexer)
    if p.tail_layers > per_round or (allowed is not None and not allowed[0]):
        return None  # the head's window cannot hold the shared-KV tail, or a round would start at a barred layer
    if p.n_devices == 1:  # the head alone runs every layer
        found = _placement(p, k, [per_round])
        return found if found is not None and np.isfinite(found.objective_s) and found.objective_s < beat else None
    w = np.arange(per_round + 1)[:, None] * np.ones(p.n_devices, dtype=np.int64)
    pred = predict_ring(p, k, w, gpu_layers(p, k, w))
    own = pred.own_s
    chain = pred.compute_s + pred.memory_s + pred.network_s + pred.fault_s
    if not relays:
        chain[0, 1:] = np.inf  # w >= 1 but for the head
    chain[: p.tail_layers, 0] = np.inf  # the head holds the last layers that must share a window
    bad = ~np.isfinite(chain) | ~np.isfinite(own)
    chain[bad], own[bad] = np.inf, np.inf
    # where windows may end matters (GLM 5.2), the dynamic program goes round the ring in its order (the nodes, then
    # the head); elsewhere the head first, as before (the order only breaks ties between equal placements)
    ring = [*range(1, p.n_devices), 0] if allowed is not None else list(range(p.n_devices))
    chain, own = chain[:, ring], own[:, ring]

    def least(bound: float) -> tuple[float, list[int] | None]:
        """The least chain within `bound`, and its w in device order (the head first)."""
        value, w_ring = _least_ring_chain(chain, own, bound, per_round, allowed)
        if w_ring is None:
            return value, None
        w = [0] * len(ring)
        for pos, i in enumerate(ring):
            w[i] = w_ring[pos]
        return value, w

    # f(t) = max(t, least chain with every device's own time <= t) is least at the first bound t_i (a value
    # some own time takes) whose least chain is within it, or at t_(i-1), whose least chain is the objective.
    # The least chain never grows with t: bisection finds i.
    floor, w_floor = least(np.inf)
    if w_floor is None or floor >= beat:
        return None
    # the unbounded optimum's own times bound the search from above: there the chain is within its largest
    top = float(own[[w_floor[i] for i in ring], np.arange(p.n_devices)].max())
    if floor >= top:
        return _placement(p, k, w_floor)  # the chain is the objective and no bound lowers it
    bounds = np.sort(own[(own >= floor) & (own <= top)])  # below the unbounded least chain, none is within
    lo, hi = 0, bounds.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if least(bounds[mid])[0] <= bounds[mid]:
            hi = mid
        else:
            lo = mid + 1
    best_t, best_w = least(bounds[lo])
    best_t = max(best_t, bounds[lo])
    lower = own[own < bounds[lo]]
    if lower.size:  # just below t_i, where the least chain exceeds the bound and is the objective
        below, w_below = least(float(lower.max()))
        if below < best_t:
            best_w = w_below
    return _placement(p, k, best_w)


def _placement(p: Platform, k: int, w: list[int] | None) -> Solution | None:
    if w is None:
        return None
    wv = np.asarray(w)
    nv = gpu_layers(p, k, wv)
    total = float(predict_ring(p, k, wv, nv).total_s)
    return Solution(k, tuple(int(x) for x in wv), tuple(int(x) for x in nv), total)


def _least_ring_chain(chain: np.ndarray, own: np.ndarray, bound: float, total: int,
                      allowed: np.ndarray | None = None) -> tuple[float, list[int] | None]:
    """min sum_m chain[w_m, m] over sum_m w_m = total with own[w_m, m] <= bound, and the w that reach it (a
    dynamic program over the devices in ring order); `allowed[t]`: whether a window may end t layers into a round."""
    cost = np.where(own <= bound, chain, np.inf)
    size = total + 1
    shift = np.arange(size)[:, None] - np.arange(size)[None, :]  # [t, w]: layers left for the devices before
    rows = np.where(shift >= 0, shift, size)  # index `size` is the padding: no such split
    best = np.append(cost[:, 0], np.inf)  # best[t]: least chain of the devices so far with t layers between them
    choices = []
    for m in range(1, cost.shape[1]):
        if allowed is not None:
            best[:size][~allowed] = np.inf  # no boundary after the devices so far at a barred start
        options = best[rows] + cost[:, m]
        pick = options.argmin(axis=1)
        best = np.append(options[np.arange(size), pick], np.inf)
        choices.append(pick)
    if not np.isfinite(best[total]):
        return float("inf"), None
    w = [0] * cost.shape[1]
    t = total
    for m in range(cost.shape[1] - 1, 0, -1):
        w[m] = int(choices[m - 1][t])
        t -= w[m]
    w[0] = t
    return float(best[total]), w
