"""A node's loaded assignment: its windows, one per round, on one mapping of the model, and its successor."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from primaplug.core.budget import MARGIN
from primaplug.core.errors import PrimaplugError, ProtocolError
from primaplug.core.windows import LayerRange
from primaplug.engine import BUSY_POLL, ContextSettings, Model, ModelLayout, Window, one_per_context
from primaplug.engine.affinity import on_cpu
from primaplug.memory.policy import plan_prefetch, repack_allowed, repack_note
from primaplug.memory.prefetcher import Prefetcher, Switches
from primaplug.memory.system import MemoryView, memory_view
from primaplug.profiler.model import compute_buffer_layers_bytes
from primaplug.transport import RingOut, Transport
from primaplug.wire import Activation, Assignment, KvOp, window_output

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySettings:
    budget_bytes: int | None = None  # for the windows' weights; None: what the OS says is available, less the rest
    switches: Switches = Switches()




def reserved_bytes(layout: ModelLayout, windows: list[LayerRange], n_ctx: int, n_batch: int, n_ubatch: int) -> int:
    """What windows need besides weights: their KV cache and their llama.cpp compute buffers. A window gives its
    buffer's pages back after a prompt (ContextSettings.release_compute), and the windows run one at a time, so
    one buffer sized for a micro-batch is resident at most, beside what a one-token decode touches in the others."""
    kv = sum(layout.kv_bytes_per_token(il) * n_ctx for w in windows for il in range(w.start, w.end))
    if not windows:
        return kv
    one_row = compute_buffer_layers_bytes(layout, n_ctx, 1, 1)
    return kv + compute_buffer_layers_bytes(layout, n_ctx, n_batch, n_ubatch) + (len(windows) - 1) * one_row


def weights_budget(view: MemoryView, reserved: int) -> int:
    """Available memory, less what is `reserved` besides the windows' weights (reserved_bytes, and on the head its
    output layer) and a margin: what the windows' weights may use. Nodes and the head size their memory plan
    with it."""
    return view.available_bytes - reserved - int(MARGIN * view.total_bytes)


class _Units:
    """Where each round's window sits in the node's prefetch plan, and the events that drive the plan.

    A node whose windows fit, or that streams whole windows (the default), has one unit per window: prefetched
    before it runs, released after. With --layer-streaming a node that streams goes layer by layer: one unit per layer,
    the window telling which layer it computes (engine/progress.py), so that each layer's streamed weights go as
    soon as it is done and the next layer's come in while it computes. Memory then never holds more than the plan
    says, which lets the kept part of every layer stay resident; streaming whole windows could keep nothing of a
    window larger than the budget (the kernel evicted kept pages along with the streamed ones, docs/memory.md).
    """

    def __init__(self, *, per_layer: bool) -> None:
        self.per_layer = per_layer
        self.first: dict[int, int] = {}  # round -> index of its window's first unit
        self.prefetcher: Prefetcher | None = None
        self._n = 0
        self._current: int | None = None

    def add(self, round_: int, window: LayerRange) -> None:
        if window.n_layers:
            self.first[round_] = self._n
            self._n += window.n_layers if self.per_layer else 1

    def hook(self, round_: int, window: LayerRange) -> Callable[[int], None] | None:
        """The window's on_layer callback (layer by layer only)."""
        if not self.per_layer or not window.n_layers:
            return None
        return lambda il: self._layer(self.first[round_] + il - window.start)

    def started(self, round_: int) -> None:
        """The round's window is about to compute (whole windows; layer by layer, the window says when)."""
        if self.prefetcher is not None and not self.per_layer:
            self.prefetcher.window_started(self.first[round_])

    def _layer(self, unit: int) -> None:  # from the computing thread
        p = self.prefetcher
        if p is None or unit == self._current:
            return
        if self._current is not None:
            p.window_done(self._current, last_of_token=False)
        p.window_started(unit)  # asks for the next layer's prefetch
        self._current = unit

    def done(self, round_: int) -> None:
        """The round's output has been sent: its last unit is done."""
        p = self.prefetcher
        if p is None:
            return
        last_round = round_ == max(self.first)
        if not self.per_layer:
            p.window_done(self.first[round_], last_of_token=last_round)
        elif self._current is not None:
            p.window_done(self._current, last_of_token=last_round)
            self._current = None


@dataclass
class Deployment:
    assignment: Assignment
    model: Model
    windows: list[Window | None]  # per round; None: this node only relays that round
    out: RingOut
    n_layer: int
    prefetcher: Prefetcher | None = None  # None for a node that only relays
    units: _Units = field(default_factory=lambda: _Units(per_layer=False))  # where each round is in the plan

    @classmethod
    def load(cls, assignment: Assignment, path: str, layout: ModelLayout, transport: Transport,
             progress: Callable[[float, str], None], memory: MemorySettings = MemorySettings(),
             pin_threads: bool | None = None) -> Deployment:
        specs = assignment.windows
        ranges = [LayerRange(w.start, w.end) for w in specs]
        used = [r for r in ranges if r.n_layers]
        gpu = [il for w in specs for il in range(w.start, w.start + w.gpu_layers)]
        a = assignment
        view = memory_view()
        reserved = reserved_bytes(layout, used, a.n_ctx, a.n_batch, a.n_ubatch)
        budget = memory.budget_bytes if memory.budget_bytes is not None else weights_budget(view, reserved)
        sw = memory.switches
        plan = plan_prefetch([layout.window_ranges(r) for r in used], budget, keep=sw.keep)
        units = _Units(per_layer=plan.mode == "stream" and sw.layers)
        if units.per_layer:  # stream layer by layer (see _Units)
            plan = plan_prefetch([layout.window_ranges(LayerRange(il, il + 1)) for r in used
                                  for il in range(r.start, r.end)], budget, keep=sw.keep, unit="layer")
        repack = repack_allowed(plan, reserved, view.total_bytes)
        progress(0.05, f"mapping {os.path.basename(path)} for windows {', '.join(map(str, used)) or '(relay only)'}"
                       f"; {plan.describe()}{repack_note(plan, repack)}")
        model = Model(path, used, output=False, gpu_layers=gpu, repack=repack, layout=layout)
        try:
            settings = ContextSettings(n_ctx=assignment.n_ctx, n_batch=assignment.n_batch,
                                       n_ubatch=assignment.n_ubatch, n_threads=assignment.n_threads,
                                       n_seq_max=assignment.n_seq_max, poll=BUSY_POLL, pin_threads=pin_threads)
            for i, r in enumerate(ranges):
                units.add(i, r)
            progress(0.1, f"creating windows {', '.join(map(str, used)) or '(none)'}"
                          f"{' on one shared context' if len(used) > 1 and model.can_share_context else ''}")
            windows = model.round_windows(ranges, settings=settings,
                                          on_layer=[units.hook(i, r) for i, r in enumerate(ranges)])
            model.pause_threads()  # asleep until a message comes (run)
            out = transport.ring_out(assignment.successor)
            prefetcher = Prefetcher(path, plan, memory.switches) if used else None
        except BaseException:
            model.close()
            raise
        units.prefetcher = prefetcher
        return cls(assignment, model, windows, out, model.layout.n_layer, prefetcher, units)

    @property
    def epoch(self) -> int:
        return self.assignment.epoch

    def run(self, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        """Compute this node's window of the message's round; returns what goes to the successor."""
        window = self.windows[msg.round] if msg.round < len(self.windows) else None
        # wake the compute threads first: their wake-up overlaps with checking the message and building the
        # graph (they poll until the work comes). On the core this thread computes on, if the threads are pinned,
        # so that a woken thread never spins on the core this thread is still running on.
        with on_cpu(window.cpu if window is not None else None):
            self.model.resume_threads()
            try:
                return self._run(msg, rows)
            finally:
                self.model.pause_threads()  # the successor computes next: no spinning on its cores

    def _run(self, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        a = self.assignment
        if msg.round >= len(self.windows):
            raise ProtocolError(f"round {msg.round} does not exist: the assignment has {len(self.windows)} round(s)")
        if msg.seq_id >= a.n_seq_max:
            raise ProtocolError(f"unknown sequence {msg.seq_id}: this assignment has {a.n_seq_max} sequence(s)")
        if msg.pos0 + msg.n_rows > a.n_ctx:
            raise ProtocolError(f"positions {msg.pos0}..{msg.pos0 + msg.n_rows - 1} exceed the context of "
                                f"{a.n_ctx} tokens")
        window = self.windows[msg.round]
        if window is None:
            return msg, rows
        if window.takes_tokens != (msg.dtype == "int32"):
            want = "token ids" if window.takes_tokens else f"hidden states (float32 x {window.n_embd})"
            raise ProtocolError(f"window {window.layers} takes {want}, got {msg.dtype} rows of width {msg.width}")
        if not window.takes_tokens and msg.width != window.n_embd:
            raise ProtocolError(f"hidden states of width {msg.width}, the model's n_embd is {window.n_embd}")
        self.units.started(msg.round)
        try:
            out = window.forward(rows[:, 0] if window.takes_tokens else rows, msg.pos0, seq_id=msg.seq_id)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        return window_output(msg, out, last_layer=window.layers.end == self.n_layer)

    def sent(self, msg: Activation) -> None:
        """The round's output has gone to the successor: its streamed weights can go."""
        if msg.round in self.units.first:
            self.units.done(msg.round)

    def apply(self, op: KvOp) -> None:
        for w in one_per_context(self.windows):  # windows on a shared context share its KV cache
            if op.op == "clear":
                w.kv_clear()
            else:
                try:
                    w.kv_remove(op.seq_id, op.p0, op.p1)
                except PrimaplugError as e:
                    raise ProtocolError(str(e)) from None

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.out.close()
        self.model.close()
