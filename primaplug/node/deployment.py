"""A node's loaded assignment: its windows (one per round, primaplug.device) and the socket to its successor."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from primaplug.core.errors import PrimaplugError, ProtocolError
from primaplug.core.windows import LayerRange
from primaplug.device import DeviceWindows, MemorySettings
from primaplug.engine import BUSY_POLL, ContextSettings, ModelLayout
from primaplug.engine.affinity import on_cpu
from primaplug.memory.heap import return_freed_memory
from primaplug.memory.prefetcher import Prefetcher
from primaplug.transport import RingOut, Transport
from primaplug.wire import Activation, Assignment, ExpertTraffic, KvOp, window_output

if TYPE_CHECKING:
    from primaplug.store import SparseCopy

log = logging.getLogger(__name__)


def planned_room(memory: MemorySettings | None, room: int) -> MemorySettings:
    """The node's memory settings with the room the plan chose (Assignment.stream_room). The node's own
    --layer-streaming and --stream-room flags, set for comparisons, win over the plan."""
    memory = memory or MemorySettings()
    sw = memory.switches
    if room < 1 or sw.layers is not None or sw.room_layers is not None:
        return memory
    return dataclasses.replace(memory, switches=dataclasses.replace(sw, layers=True, room_layers=room))


@dataclass
class Deployment:
    assignment: Assignment
    device: DeviceWindows
    out: RingOut
    n_layer: int
    copy: SparseCopy | None = None  # the fetched copy it runs from (None: a whole file the node was given)

    @classmethod
    def load(cls, assignment: Assignment, path: str, layout: ModelLayout, transport: Transport,
             progress: Callable[[float, str], None], memory: MemorySettings | None = None,
             pin_threads: bool | None = None, copy: SparseCopy | None = None) -> Deployment:
        a = assignment
        ranges = [LayerRange(w.start, w.end) for w in a.windows]
        gpu = [il for w in a.windows for il in range(w.start, w.start + w.gpu_layers)]
        context = ContextSettings(n_ctx=a.n_ctx, n_batch=a.n_batch, n_ubatch=a.n_ubatch, n_threads=a.n_threads,
                                  n_seq_max=a.n_seq_max, poll=BUSY_POLL, pin_threads=pin_threads,
                                  n_rs_seq=a.n_rs_seq, row_end=a.row_end)
        device = DeviceWindows.load(path, layout, ranges, context=context, memory=planned_room(memory, a.stream_room),
                                    gpu_layers=gpu, progress=progress, repack_in=copy)
        try:
            device.warm_up()
            out = transport.ring_out(a.successor)
        except BaseException:
            device.close()
            raise
        # what loading freed goes back now, not at the first prompt: writing a W1 phone's repacked copy in parts left
        # 16 MiB free in the heap (engine/repacked.py), and its warm-up's batch more
        return_freed_memory()
        return cls(a, device, out, layout.n_layer, copy)

    @property
    def epoch(self) -> int:
        return self.assignment.epoch

    @property
    def prefetcher(self) -> Prefetcher | None:  # None for a relay
        return self.device.prefetcher

    def expert_traffic(self) -> ExpertTraffic | None:
        """A streaming mixture of experts' reads of its routed experts; None when it reads whole layers."""
        cache = self.device.experts
        if cache is None:
            return None
        cache.wait_idle()
        s = cache.stats
        return ExpertTraffic(tokens=s.tokens, chosen=s.needed, resident=s.resident, predicted=s.predicted,
                             bytes_chosen=s.bytes_needed, bytes_read=s.bytes_read,
                             bytes_predicted_unused=s.bytes_predicted_unused)

    def run(self, msg: Activation, rows: np.ndarray, embd: bytes | memoryview = b"") -> tuple[Activation, np.ndarray]:
        """Compute this node's window of the message's round; returns what goes to the successor. `embd`: the
        token embedding's rows of msg.embd_rows (wire/ring.py)."""
        window = self.device.window(msg.round)
        if window is not None and window.takes_tokens and self.copy is not None:
            if msg.embd_rows:
                self.copy.write_rows(msg.embd_rows, embd)
            lacking = self.copy.lacks_rows(rows[:, 0])
            if lacking:
                raise ProtocolError(f"token(s) {lacking[:8]}: this node fetched no token embedding, and their rows "
                                    "came with no message: the head must send them (wire/ring.py)")
        # wake the compute threads first: their wake-up overlaps with checking the message and building the
        # graph (they poll until the work comes). On the core this thread computes on, if the threads are pinned,
        # so that a woken thread never spins on the core this thread is still running on.
        with on_cpu(window.cpu if window is not None else None), self.device.awake():
            return self._run(msg, rows)

    def _run(self, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        a = self.assignment
        if msg.round >= len(a.windows):
            raise ProtocolError(f"round {msg.round} does not exist: the assignment has {len(a.windows)} round(s)")
        if msg.n_rows > a.n_batch:
            raise ProtocolError(f"{msg.n_rows} rows in one message: this assignment's batches hold {a.n_batch}")
        for p in msg.parts:
            if p.seq_id >= a.n_seq_max:
                raise ProtocolError(f"unknown sequence {p.seq_id}: this assignment has {a.n_seq_max} sequence(s)")
            if p.pos0 + p.n_rows > a.n_ctx_seq:
                raise ProtocolError(f"positions {p.pos0}..{p.pos0 + p.n_rows - 1} of sequence {p.seq_id} exceed the "
                                    f"context of {a.n_ctx_seq} tokens a sequence")
        window = self.device.window(msg.round)
        if window is None:
            return msg, rows
        if window.takes_tokens != (msg.dtype == "int32"):
            want = "token ids" if window.takes_tokens else f"hidden states (float32 x {window.in_width})"
            raise ProtocolError(f"window {window.layers} takes {want}, got {msg.dtype} rows of width {msg.width}")
        ahead = window.in_width - window.n_embd  # per-layer inputs (Gemma 4 E2B/E4B)
        if not window.takes_tokens and (msg.width != window.in_width or msg.per_layer != ahead):
            raise ProtocolError(f"hidden states of width {msg.width} ({msg.per_layer} of them per-layer inputs)"
                                f", window {window.layers} takes {window.in_width} ({ahead})")
        try:
            out = self.device.compute(msg.round, rows[:, 0] if window.takes_tokens else rows, msg.positions(),
                                      seq_id=msg.seq_ids())
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        return window_output(msg, out, last_layer=window.layers.end == self.n_layer, n_embd=window.n_embd)

    def sent(self, msg: Activation) -> None:
        """The round's output has gone to the successor: its streamed weights can go, and after a batch of several
        rows (a prompt's, or the steps of several requests) what its computation freed goes back to the OS. Measured
        on the memory testbed, that took 0.6-1.1 points off every node's memory pressure (d4 6.2-6.5% to 5.3-5.9% of
        its cap), at no cost in TPOT; a trim takes about 0.1 ms once little is free, off the ring's path."""
        self.device.done(msg.round)
        if msg.n_rows > 1:
            return_freed_memory()

    def apply(self, op: KvOp) -> None:
        if op.op == "clear":
            self.device.kv_clear()
            return
        # llama.cpp asserts on a sequence id outside its sequences: check every field before it gets there
        n_seq = self.assignment.n_seq_max
        if not 0 <= op.seq_id < n_seq or op.p0 < 0 or op.p1 < -1 or (op.p1 != -1 and op.p1 < op.p0):
            raise ProtocolError(f"cannot remove positions [{op.p0}, {op.p1}) of sequence {op.seq_id}: this "
                                f"assignment has sequences 0..{n_seq - 1}, and positions start at 0")
        try:
            self.device.kv_remove(op.seq_id, op.p0, op.p1)
        except PrimaplugError as e:
            raise ProtocolError(str(e)) from None

    def close(self) -> None:
        self.device.close()
        self.out.close()
        return_freed_memory()
