"""How far ahead each streaming device reads (its room), chosen from the ring's timing.

A node that streams layer by layer keeps a fraction f of every layer and leaves room for r layers' streamed parts
beside it (device/memory.py, memory/policy.py: `slots`). More room lets it read more of its next window while the
other devices compute; less keeps more of every layer, so it reads fewer bytes a token but more of them in its own
turn. Which pays depends on how long the others take between its turns, so rooms are priced round by round (the
ring model, ring.py, prices a token as a whole). In a round the devices take turns; device m's turn lasts its
compute, or the reading its room could not hold before its turn, whichever is longer, and its disk reads its whole
need within the round:

    R = max( sum_m max(c_m, (need_m - room_m) / s_m) + hop_m ,  max_m need_m / s_m )        a token: k R

with need_m the bytes it streams a window, room_m the bytes its room holds, c_m its compute and memory time a
window, hop_m its hop and s_m its disk rate. A device with no room for one layer reads it page by page as it
computes, at PAGE_BY_PAGE of its disk's rate (docs/memory.md: 32 against 122-129 MB/s on the emulated cluster).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from primaplug.core.budget import READ_AHEAD_SLACK, kept_fraction, slack_fraction
from primaplug.scheduler.latency import MACOS_METAL, Platform
from primaplug.scheduler.ring import predict_ring, stream_bytes, weights_budget

PAGE_BY_PAGE = 0.25  # the share of a disk's rate that pages faulting in one by one reach
GAIN = 0.03  # rooms the nodes' own rule does not choose are sent only where the model expects this much less time


@dataclass(frozen=True)
class Turn:
    """One device in the per-round model: what it computes and streams in a window of its own."""

    compute_s: float  # compute and memory time a window (and, for devices that read on the token's path, that)
    hop_s: float  # passing the hidden state on
    need_bytes: float = 0.0  # streamed a window
    room_bytes: float = 0.0  # of those, what it may read before its turn
    disk_bps: float = 1.0

    @property
    def turn_s(self) -> float:
        """Its turn and hop: its compute, or the reading its room could not hold ahead, whichever is longer."""
        return max(self.compute_s, (self.need_bytes - self.room_bytes) / self.disk_bps) + self.hop_s

    @property
    def disk_s(self) -> float:
        """Its disk's reading in a round."""
        return self.need_bytes / self.disk_bps


@dataclass(frozen=True)
class Rooms:
    """Each device's room in layers (0: the node's own rule) and the per-round model's time per token."""

    rooms: tuple[int, ...]
    tpot_s: float  # with these rooms
    own_rule_s: float  # with every node's own rule (device/memory.py: faults_in, a window's layers and one)


def round_s(turns: Sequence[Turn]) -> float:
    """A round of the devices' turns (see the module's doc)."""
    return max(sum(t.turn_s for t in turns), max((t.disk_s for t in turns), default=0.0))


def layer_turn(base: Turn, budget: float, layers: int, per_window: int, layer_bytes: float,
               room: int) -> tuple[Turn, bool]:
    """A device streaming `layers` layers a token layer by layer, `per_window` of them a window, with room for
    `room` layers beside the kept part (memory/policy.py: plan_prefetch with slots=room, and at least room_slack
    beside it; then Schedule's lookahead, which reads ahead as many whole layers as fit); and whether room_slack
    bound it (the device keeps nearly all its budget, in parts too small for its room)."""
    f = kept_fraction(budget, layers * layer_bytes, layer_bytes, room)
    slack_keep = slack_fraction(budget, layers * layer_bytes)
    f, slack_bound = min(f, slack_keep), slack_keep < f
    part = (1 - f) * layer_bytes
    # (the node sizes its plan in whole pages, so its room holds them all; 1e-9: a quotient of exactly r)
    ahead = min(layers, math.floor((budget - f * layers * layer_bytes) / part + 1e-9)) if part > 0 else room
    if ahead < 1:  # not one layer fits beside the kept part: it faults in as the window computes
        return Turn(base.compute_s, base.hop_s, per_window * part, 0.0, base.disk_bps * PAGE_BY_PAGE), slack_bound
    return Turn(base.compute_s, base.hop_s, per_window * part, ahead * part, base.disk_bps), slack_bound


def choose_rooms(p: Platform, k: int, w: Sequence[int] | np.ndarray, n: Sequence[int] | np.ndarray) -> Rooms:
    """The rooms that make the per-round model's token fastest for placement (k, w, n), exactly, over each streaming
    node's own rule and every room from one layer to a window's layers and one. Devices that fit, relays, the head,
    Metal devices and streaming mixtures of experts (which read their routed experts as tokens choose them) keep
    their own rule (0); a head that streams is priced by it, as a node is (its windows are on the same device
    layer), so that its disk's reading bounds the round as every node's does."""
    w = np.asarray(w, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    pred = predict_ring(p, k, w, n)
    per_window = w - n  # CPU layers of each window: what takes RAM and may stream
    lc = k * per_window
    budget = weights_budget(p, k, lc)
    read, faulted = stream_bytes(budget, per_window * p.layer_bytes, k)
    candidates: list[int] = []  # streaming nodes: their rooms are chosen here
    streaming: list[int] = []  # those and a streaming head, which reads by its own rule as a node does
    base: list[Turn] = []
    for m in range(p.n_devices):
        on_path = float(pred.compute_s[m] + pred.memory_s[m])
        turn = Turn(on_path / k, float(pred.network_s[m]) / k, disk_bps=float(max(p.disk_bps[m], 1.0)))
        streams = (read[m] > 0 and lc[m] > 0 and p.kind[m] != MACOS_METAL and p.disk_bps[m] > 0
                   and not (p.expert_bytes and p.expert_share))
        if streams:
            streaming.append(m)
            if not p.head[m]:
                candidates.append(m)
        elif np.isfinite(pred.fault_s[m]):  # what it reads on the token's path is part of its turn
            turn = Turn(turn.compute_s + float(pred.fault_s[m]) / k, turn.hop_s)
        base.append(turn)

    def own_rule(m: int) -> Turn:  # device/memory.py: whole windows unless they would fault in
        if faulted[m] / k > READ_AHEAD_SLACK:
            return layer_turn(base[m], budget[m], int(lc[m]), int(per_window[m]), p.layer_bytes,
                              int(per_window[m]) + 1)[0]
        return Turn(base[m].compute_s, base[m].hop_s, read[m] / k, (read[m] - faulted[m]) / k, base[m].disk_bps)

    # each device's options, (room, turn): its own rule (0), and each room from 1 to a window's layers and one, but
    # for those room_slack binds: measured, such rooms of a few MiB a layer faulted in most of what they streamed
    # (twice the memory: 60-80 MB a token on d3, 2.3-3.0 s against 1.95-2.12 with the nodes' own rules)
    options = [[(0, own_rule(m) if m in streaming else base[m])] for m in range(p.n_devices)]
    for m in candidates:
        for r in range(1, int(per_window[m]) + 2):
            turn, slack_bound = layer_turn(base[m], budget[m], int(lc[m]), int(per_window[m]), p.layer_bytes, r)
            if not slack_bound:
                options[m].append((r, turn))
    own_s = k * round_s([o[0][1] for o in options])
    rooms, best = _best_rooms(options)
    if k * best > own_s * (1 - GAIN):
        return Rooms(tuple([0] * p.n_devices), own_s, own_s)
    return Rooms(tuple(rooms), k * best, own_s)


def _best_rooms(options: list[list[tuple[int, Turn]]]) -> tuple[list[int], float]:
    """The choice of one option per device with the shortest round, exactly: a round is the longer of a sum over the
    devices (their turns and hops) and a maximum (their disks' reading), so for each bound t on every disk's reading
    each device takes its shortest turn within t, and the best t is one of the values a disk's reading takes."""
    bounds = sorted({t.disk_s for o in options for _, t in o})
    best, choice = float("inf"), [0] * len(options)
    for bound in bounds:
        picks = []
        for o in options:
            within = [(t.turn_s, r) for r, t in o if t.disk_s <= bound]
            if not within:
                break
            picks.append(min(within))
        else:
            round_ = max(sum(s for s, _ in picks), bound)
            if round_ < best * (1 - 1e-9):
                best, choice = round_, [r for _, r in picks]
    return choice, best
