"""Ring messages: what travels from each device to the next.

An Activation is two frames: a msgpack header and the raw little-endian rows (int32 token ids before the
first layer, float32 hidden states after it), sent without copying. Token ids may bring a third: the token
embedding's rows, as the model file stores them, of the ids the first node may lack (a node that fetched its layers
holds no embedding; the head sends each row it has not yet seen arrive: head/embedding.py). Its rows are one or
more parts, each a run of consecutive positions of one sequence: the head batches the steps of several requests
(continuous batching), and every window computes them in one call. KV operations and errors travel the same
way, header only, so they stay in order with the activations: every node applies a KvOp to all its windows and
passes it on; a node that cannot serve a message passes a RingError on instead, and the head raises it.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from primaplug.core.errors import ProtocolError
from primaplug.wire.messages import DECODE_ERRORS, PROTOCOL_VERSION

DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}
# The largest header read. A real one is small (at most one part per sequence, a few words each, or an error's
# sentence); a header of a hundred thousand parts would cost a hundred times its size in objects once decoded.
MAX_RING_HEADER_BYTES = 64 * 1024


class _RingMsg(msgspec.Struct, frozen=True, tag_field="kind"):
    proto: int
    epoch: int  # the assignment these belong to
    step: int  # numbered by the head, one per batch it sends round the ring


class Part(msgspec.Struct, frozen=True, array_like=True):
    """n_rows consecutive positions [pos0, pos0 + n_rows) of sequence seq_id; all_rows: whether the head needs
    every row of it after the last layer, or only the last one."""

    seq_id: int
    pos0: int
    n_rows: int
    all_rows: bool = False


class Activation(_RingMsg, tag="act", omit_defaults=True):  # no embedding rows: nothing on the wire
    """Rows entering round `round`: the parts' rows one after the other (at most one part per sequence)."""

    round: int
    parts: tuple[Part, ...]
    width: int  # 1 for token ids, n_embd for hidden states (and per_layer more)
    dtype: Literal["int32", "float32"]
    # Gemma 4 E2B/E4B: the per-layer inputs of the layers still ahead, after each row's n_embd hidden values (the
    # head computes every layer's from the tokens; each window reads its own and passes the rest on)
    per_layer: int = 0
    embd_rows: tuple[int, ...] = ()  # token ids whose embedding rows follow, in this order, in a third frame

    @property
    def n_rows(self) -> int:
        return sum(p.n_rows for p in self.parts)

    def positions(self) -> np.ndarray:
        """Each row's position."""
        return np.concatenate([np.arange(p.pos0, p.pos0 + p.n_rows, dtype=np.int32) for p in self.parts])

    def seq_ids(self) -> np.ndarray:
        """Each row's sequence."""
        return np.concatenate([np.full(p.n_rows, p.seq_id, dtype=np.int32) for p in self.parts])


class KvOp(_RingMsg, tag="kv"):
    """Forget positions [p0, p1) of a sequence (p1 = -1: to the end) in every window; op "clear": everything."""

    op: Literal["clear", "remove"]
    seq_id: int = 0
    p0: int = 0
    p1: int = -1


class RingError(_RingMsg, tag="err"):
    """A node could not serve a ring message; passed on to the head unchanged by the others."""

    node: str
    code: str
    message: str


RingMessage = Activation | KvOp | RingError


def window_output(msg: Activation, out: np.ndarray, *, last_layer: bool, n_embd: int) -> tuple[Activation, np.ndarray]:
    """What a window that received `msg` sends on: its hidden rows (float32, n x (n_embd + the per-layer inputs
    still ahead)). After the model's last layer only each part's last row goes on, unless the head asked for every
    row of that part."""
    parts = msg.parts
    if last_layer and not all(p.all_rows for p in parts):
        keep: list[int] = []
        kept: list[Part] = []
        start = 0
        for p in parts:
            if p.all_rows:
                keep.extend(range(start, start + p.n_rows))
                kept.append(p)
            else:
                keep.append(start + p.n_rows - 1)
                kept.append(Part(p.seq_id, p.pos0 + p.n_rows - 1, 1, False))
            start += p.n_rows
        out, parts = out[keep], tuple(kept)
    nxt = Activation(proto=msg.proto, epoch=msg.epoch, step=msg.step, round=msg.round, parts=parts,
                     width=out.shape[1], dtype="float32", per_layer=out.shape[1] - n_embd)
    return nxt, out

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(RingMessage)


def encode_ring(msg: RingMessage, rows: np.ndarray | None = None, embd: bytes = b"") -> list[bytes | memoryview]:
    """The frames of a ring message. Activations carry their rows as a second frame (a view, not a copy), and the
    embedding rows of msg.embd_rows as a third."""
    frames: list[bytes | memoryview] = [_enc.encode(msg)]
    if isinstance(msg, Activation):
        if rows is None:
            raise ValueError("an Activation needs its rows")
        arr = np.ascontiguousarray(rows, dtype=DTYPES[msg.dtype])
        frames.append(memoryview(arr).cast("B") if arr.size else b"")
        if msg.embd_rows:
            frames.append(embd)
    return frames


class RingFrameError(ProtocolError):
    """A ring message whose header was read but whose body does not fit it: `step` says which message it was, so
    that the refusal reaches the head as the answer to that step instead of being lost."""

    def __init__(self, step: int, message: str) -> None:
        self.step = step
        super().__init__(message)


def decode_ring(frames: list[bytes | memoryview]) -> tuple[RingMessage, np.ndarray | None]:
    """The message and, for an Activation, its rows (n_rows x width), checked against the header."""
    if not frames:
        raise ProtocolError("empty ring message")
    if len(frames[0]) > MAX_RING_HEADER_BYTES:
        raise ProtocolError(f"ring header of {len(frames[0])} bytes, more than any real one "
                            f"({MAX_RING_HEADER_BYTES}): not decoded")
    try:
        msg = _dec.decode(frames[0])
    except msgspec.ValidationError as e:
        # a header that decodes but does not validate still says which step it was: the refusal then reaches the
        # head as the answer to that step, not as a message it ignores until its timeout
        step = _step_of(frames[0])
        if step is not None:
            raise RingFrameError(step, f"malformed ring header of step {step}: {e}") from None
        raise ProtocolError(f"malformed ring header: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed ring header: {e}") from None
    if msg.proto != PROTOCOL_VERSION:
        raise ProtocolError(f"ring message speaks protocol {msg.proto}, this side speaks {PROTOCOL_VERSION}: "
                            "run the same primaplug version on every device")
    if not isinstance(msg, Activation):
        if len(frames) != 1:
            raise RingFrameError(msg.step, f"a {type(msg).__name__} has one frame, got {len(frames)}")
        return msg, None
    if len(frames) != 2 + bool(msg.embd_rows):
        raise RingFrameError(msg.step, f"an activation has {2 + bool(msg.embd_rows)} frames (header, rows"
                             f"{', embedding rows' if msg.embd_rows else ''}), got {len(frames)}")
    if msg.embd_rows and (msg.dtype != "int32" or not len(frames[2]) or len(frames[2]) % len(msg.embd_rows)
                          or min(msg.embd_rows) < 0):
        raise RingFrameError(msg.step, f"activation step {msg.step}: {len(frames[2])} bytes of embedding rows for "
                             f"{len(msg.embd_rows)} token(s) of {msg.dtype} rows")
    bad = [p for p in msg.parts if p.n_rows < 1 or p.pos0 < 0 or p.seq_id < 0]
    if not msg.parts or bad or msg.width < 1 or msg.round < 0:
        raise RingFrameError(msg.step, f"activation step {msg.step}: bad shape or position "
                            f"({len(msg.parts)} part(s){f', such as {bad[0]}' if bad else ''}, width {msg.width}, "
                            f"round {msg.round})")
    if len({p.seq_id for p in msg.parts}) != len(msg.parts):
        raise RingFrameError(msg.step, f"activation step {msg.step}: a sequence in two parts "
                             f"({[p.seq_id for p in msg.parts]})")
    if msg.per_layer < 0 or msg.per_layer >= msg.width or (msg.per_layer and msg.dtype != "float32"):
        raise RingFrameError(msg.step, f"activation step {msg.step}: {msg.per_layer} per-layer values in rows of "
                             f"width {msg.width} ({msg.dtype})")
    if (msg.dtype == "int32") != (msg.width == 1):
        raise RingFrameError(msg.step, f"activation step {msg.step}: {msg.dtype} rows of width {msg.width} "
                            "(token ids are int32 of width 1, hidden states float32 of width n_embd)")
    dtype = DTYPES[msg.dtype]
    payload = frames[1]
    expect = msg.n_rows * msg.width * dtype.itemsize
    if len(payload) != expect:
        raise RingFrameError(msg.step, f"activation step {msg.step}: buffer holds {len(payload)} bytes, the header "
                             f"says {msg.n_rows} rows x {msg.width} x {dtype.itemsize} = {expect}")
    rows = np.frombuffer(payload, dtype=dtype).reshape(msg.n_rows, msg.width)
    return msg, rows


def _step_of(header: bytes | memoryview) -> int | None:
    """The step a header names, read leniently from one that failed validation (None: it names none)."""
    try:
        raw = msgspec.msgpack.decode(header)
    except DECODE_ERRORS:
        return None
    step = raw.get("step") if isinstance(raw, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
