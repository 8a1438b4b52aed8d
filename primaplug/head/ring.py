"""The head's end of the ring: send messages round it, run the head's own windows, and watch for dead nodes.

With k rounds a trip goes round k times; in each round every node runs its window of that round and the head
runs its own last, so the model's final layer lands on the head, which runs the output layer (head/batching.py).
While it waits, the head asks the nodes for their status (after half a second of silence, on the control
channel): a node that answers nothing for `timeout_s` is reported dead, with what the ring was doing (Watch).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from primaplug.core.errors import NodeError, NodeUnavailableError, ProtocolError
from primaplug.core.settings import TIMEOUT_S
from primaplug.device import DeviceWindows
from primaplug.head.embedding import EmbeddingRows
from primaplug.head.nodes import NodeClient
from primaplug.transport import RingIn, RingOut
from primaplug.wire import (
    PROTOCOL_VERSION,
    Activation,
    KvOp,
    Part,
    RingError,
    RingMessage,
    decode_ring,
    encode_ring,
    window_output,
)

if TYPE_CHECKING:
    from primaplug.engine import Window

log = logging.getLogger(__name__)

class RingHead:
    """The ring as the head drives it: the nodes in ring order, then the head's own windows (`local`, one per round;
    None when the head runs only the output layer). Without nodes the head runs every window itself, one per
    "round". It sends and receives messages and runs the head's windows; head/batching.py decides what goes when."""

    def __init__(self, nodes: Sequence[NodeClient], ring_in: RingIn | None, ring_out: RingOut | None, epoch: int,
                 local: DeviceWindows | None, rounds: int, n_layer: int, n_embd: int,
                 timeout_s: float = TIMEOUT_S, embedding: EmbeddingRows | None = None,
                 entry: Window | None = None, keep_from: int = 0) -> None:
        self.nodes = list(nodes)
        self.ring_in, self.ring_out = ring_in, ring_out
        self.epoch = epoch
        self.local = local
        self.rounds = rounds
        self.n_layer, self.n_embd = n_layer, n_embd
        self.timeout_s = timeout_s
        self.embedding = embedding  # the first node fetched its layers: its tokens bring their embedding rows
        self.entry = entry  # the input window [0, 0) of a model with per-layer inputs (Gemma 4 E2B/E4B), else None
        # the head's last window starts here: it keeps those layers' per-layer inputs (Cluster.row_end), by
        # (sequence, first position) of each part, until the part's rows come back to that window; 0: none kept
        self.keep_from = keep_from
        self._kept: dict[tuple[int, int], np.ndarray] = {}

    @property
    def has_nodes(self) -> bool:
        return self.ring_out is not None and self.ring_in is not None

    def activation(self, step: int, parts: Sequence[Part]) -> Activation:
        """The message that takes token ids of these parts into round 0."""
        return Activation(proto=PROTOCOL_VERSION, epoch=self.epoch, step=step, round=0, parts=tuple(parts),
                          width=1, dtype="int32")

    def enter(self, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        """What goes into round 0 for token ids: the ids, or on a model with per-layer inputs the rows its input
        window computes from them (the hidden state, then every layer's per-layer input), which travel round the
        ring and shrink by each window's layers (wire/ring.py, Activation.per_layer)."""
        if self.entry is None or msg.dtype != "int32":
            return msg, rows
        out = self.entry.forward(rows[:, 0], msg.positions(), seq_id=msg.seq_ids())
        if self.keep_from:
            cut = self.entry.model.layout.row_width(0, self.keep_from)
            start = 0
            for p in msg.parts:
                # a sequence has one step in the ring at a time: what it kept before belongs to a failed trip
                for stale in [key for key in self._kept if key[0] == p.seq_id]:
                    del self._kept[stale]
                self._kept[(p.seq_id, p.pos0)] = out[start: start + p.n_rows, cut:]
                start += p.n_rows
            out = out[:, :cut]
        return msgspec.structs.replace(msg, width=out.shape[1], dtype="float32",
                                       per_layer=out.shape[1] - self.n_embd), out

    def _take_kept(self, msg: Activation, rows: np.ndarray) -> np.ndarray:
        """The rows with the per-layer inputs the head kept for its last window put back after each part's."""
        start, out = 0, []
        for p in msg.parts:
            kept = self._kept.pop((p.seq_id, p.pos0), None)
            if kept is None or len(kept) != p.n_rows:
                raise ProtocolError(f"rows of sequence {p.seq_id} from position {p.pos0} came back without the "
                                    "per-layer inputs the head kept for them")
            out.append(np.concatenate([rows[start: start + p.n_rows], kept], axis=1))
            start += p.n_rows
        return np.concatenate(out) if len(out) > 1 else out[0]

    def kv_op(self, step: int, seq_id: int, p0: int = 0, p1: int = -1) -> KvOp:
        return KvOp(proto=PROTOCOL_VERSION, epoch=self.epoch, step=step, op="remove", seq_id=seq_id, p0=p0, p1=p1)

    def send(self, msg: RingMessage, rows: np.ndarray | None, what: str) -> None:
        """Hand a message to the first node."""
        assert self.ring_out is not None
        embd = b""
        if self.embedding is not None and isinstance(msg, Activation) and msg.dtype == "int32" and rows is not None:
            msg, embd = self.embedding.attach(msg, rows[:, 0])
        if not self.ring_out.send(encode_ring(msg, rows, embd), self.timeout_s):
            raise NodeUnavailableError(self.nodes[0].name, f"node {self.nodes[0]} did not take step {msg.step} "
                                       f"({what}) within {self.timeout_s:.1f} s")

    def recv(self, timeout_s: float) -> tuple[RingMessage, np.ndarray | None] | None:
        """The next message back from the last node that belongs to this assignment, or None after timeout_s."""
        assert self.ring_in is not None
        frames = self.ring_in.recv(timeout_s)
        if frames is None:
            return None
        got, out = decode_ring(frames)
        if got.epoch != self.epoch:
            log.debug("dropped a ring message of assignment %d step %d", got.epoch, got.step)
            if isinstance(got, RingError):
                log.warning("node %s reported: %s", got.node, got.message)
            return None
        if self.embedding is not None:
            self.embedding.returned(got.step, ok=not isinstance(got, RingError))
        return got, out

    def local_round(self, r: int, msg: Activation, rows: np.ndarray) -> tuple[Activation, np.ndarray]:
        """The head's own window of round r over the message's rows, if it has one; what goes on."""
        w = self.local.window(r) if self.local is not None else None
        if w is None:
            return msg, rows
        assert self.local is not None
        if self.keep_from and w.layers.start == self.keep_from:
            rows = self._take_kept(msg, rows)
        inputs = rows[:, 0] if w.takes_tokens else rows
        with self.local.awake() if self.nodes else contextlib.nullcontext():  # alone: awake for the whole trip
            out = self.local.compute(r, inputs, msg.positions(), seq_id=msg.seq_ids())
        self.local.done(r)
        return window_output(msg, out, last_layer=w.layers.end == self.n_layer, n_embd=self.n_embd)

    def local_kv(self, op: KvOp) -> None:
        if self.local is not None:
            self.local.kv_clear() if op.op == "clear" else self.local.kv_remove(op.seq_id, op.p0, op.p1)

    def check_hidden(self, msg: Activation) -> None:
        if msg.dtype != "float32" or msg.width != self.n_embd or msg.per_layer:
            raise ProtocolError(f"the ring returned {msg.dtype} rows of width {msg.width}, not hidden states")

    def watch(self, now: float) -> Watch:
        return Watch(self.nodes, now)


class Watch:
    """What the head hears from the nodes while it waits for one ring message."""

    def __init__(self, nodes: Sequence[NodeClient], now: float) -> None:
        self.nodes = nodes
        self.heard = {n: now for n in nodes}
        self.idle_since: float | None = None

    def poll(self, now: float) -> None:
        for n in self.nodes:
            if n.poll_probe() is not None or n.last_heard > self.heard[n]:  # a probe, or another request's reply
                self.heard[n] = now
            n.probe()

    def check(self, now: float, timeout_s: float, epoch: int, doing: str) -> None:
        dead = [n for n in self.nodes if now - self.heard[n] > timeout_s]
        if dead:
            alive = [str(n) for n in self.nodes if n not in dead]
            last = dead[0].last_status
            was = f"; its last status: {last.activity or last.state}" if last else ""
            raise NodeUnavailableError(
                dead[0].name,
                f"node {dead[0]} stopped answering for {timeout_s:.1f} s while the ring computed {doing}{was}. "
                + (f"Still answering: {', '.join(alive)}."
                   if alive else "No node answers."))
        statuses = [(n, n.last_status) for n in self.nodes]
        for n, s in statuses:
            by = n.taken_by(s) if s is not None else None
            if by is not None:
                raise NodeError(str(n), "taken", f"was taken over by {by.describe()} while the ring computed {doing}")
            if s is not None and (s.state != "ready" or s.epoch != epoch):
                raise NodeError(str(n), "not_ready", f"is {s.state} with assignment {s.epoch}, not {epoch}, while "
                                f"the ring computed {doing}: did it restart? Deploy the assignment again.")
        # every node alive and idle, yet nothing arrives: the message was lost (a node restarted in between)
        if all(s is not None and not s.activity for _, s in statuses):
            self.idle_since = self.idle_since or now
            if now - self.idle_since > timeout_s:
                raise NodeError(str(self.nodes[0]), "lost", f"the ring lost {doing}: every node is alive and idle")
        else:
            self.idle_since = None
