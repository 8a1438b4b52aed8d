"""Wire messages: every type round-trips, and its bytes are pinned so an accidental protocol change fails here
(a deliberate one bumps PROTOCOL_VERSION and updates the golden hex)."""

from __future__ import annotations

import numpy as np
import pytest

from primaplug.core import ProtocolError
from primaplug.core.profiles import DeviceProfile
from primaplug.wire import (
    PROTOCOL_VERSION,
    Activation,
    Assignment,
    DeviceFacts,
    ErrorReply,
    GetProfile,
    GetStatus,
    HeadTag,
    Hello,
    Holder,
    KvOp,
    LoadAssignment,
    ModelIdentity,
    Part,
    ProfileReply,
    RingError,
    RingFrameError,
    Shutdown,
    Status,
    Unload,
    Welcome,
    WindowSpec,
    decode_reply,
    decode_request,
    decode_ring,
    encode,
    encode_ring,
)

IDENT = ModelIdentity(identity="1000:abcd", file_name="m.gguf", n_layer=18, n_embd=640)
ASSIGN = Assignment(epoch=7, model=IDENT, windows=(WindowSpec(0, 6), WindowSpec(9, 12, 2)),
                    successor="tcp://127.0.0.1:7001", n_ctx=512, n_batch=64, n_ubatch=32)
HEAD = HeadTag(id="0123456789abcdef", name="primaplug serve (pid 7) on box", address="tcp://127.0.0.1:9000",
               started=1.7e9, served=3)
HOLDER = Holder(head=HEAD, since=1.7e9 + 5, silent_s=0.4, lease_s=10.0)
REQUESTS = [Hello(proto=PROTOCOL_VERSION, software="0.1.0"), LoadAssignment(assignment=ASSIGN), GetStatus(),
            GetProfile(model="1000:abcd", force=True), Unload(), Shutdown(),
            LoadAssignment(assignment=ASSIGN, head=HEAD, take_over=True), GetStatus(detail=True, head=HEAD),
            Unload(head=HEAD, release=True), Shutdown(head=HEAD, take_over=True)]
PROFILE = DeviceProfile(name="a", os="android", backend="cpu", cpu_count=8, cpu_flops={"Q4_K": 2e10, "F32": 5e9},
                        mem_total_bytes=8 << 30, mem_available_bytes=2 << 30, swap_can_bytes=1 << 30,
                        disk_seq_bps=1.4e9, link_latency_s=0.007, link_bps=4e7)
REPLIES = [
    Welcome(proto=1, software="0.1.0", node="a", models=(IDENT,),
            device=DeviceFacts(os="Linux", machine="x86_64", cpu_count=2, mem_total_bytes=1 << 30,
                               mem_available_bytes=1 << 29), ring_endpoint="tcp://127.0.0.1:7001"),
    Status(node="a", state="ready", epoch=7, progress=1.0, message="ready", last_step=3, steps_done=4),
    ErrorReply(node="a", code="wrong_model", message="no"),
    ErrorReply(node="a", code="held", message="held", holder=HOLDER),
    Status(node="a", state="ready", epoch=7, holder=HOLDER),
    ProfileReply(node="a", profile=PROFILE),
    ProfileReply(node="a", message="measuring"),
]
ACT = Activation(proto=PROTOCOL_VERSION, epoch=7, step=3, round=1, parts=(Part(0, 10, 2),), width=4,
                 dtype="float32")

GOLDEN = {  # protocol 4: token ids may bring embedding rows (absent from the header when there are none)
    "hello": "83a46b696e64a568656c6c6fa570726f746f04a8736f667477617265a5302e312e30",
    "act": "88a46b696e64a3616374a570726f746f04a565706f636807a47374657003a5726f756e6401a570617274739194000a02c2"
           "a5776964746804a56474797065a7666c6f61743332",
}


def test_a_holder_is_described_with_what_a_refused_head_needs() -> None:
    text = HOLDER.describe()
    for part in ("head 01234567", "primaplug serve (pid 7) on box", "tcp://127.0.0.1:9000", "served 3 request(s)",
                 "last spoke 0.4 s ago", "since 20"):
        assert part in text, (part, text)


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg) -> None:
    assert decode_request(encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(msg) -> None:
    assert decode_reply(encode(msg)) == msg


def test_golden_bytes() -> None:
    assert encode(REQUESTS[0]).hex() == GOLDEN["hello"]
    assert encode_ring(ACT, np.zeros((2, 4), np.float32))[0].hex() == GOLDEN["act"]


def test_token_ids_bring_their_embedding_rows_in_a_third_frame() -> None:
    ids = Activation(proto=PROTOCOL_VERSION, epoch=7, step=4, round=0, parts=(Part(0, 0, 3),), width=1,
                     dtype="int32", embd_rows=(5, 9))
    frames = encode_ring(ids, np.array([[5], [9], [5]], np.int32), b"a" * 6 + b"b" * 6)
    msg, rows = decode_ring([bytes(f) for f in frames])
    assert msg == ids and len(frames) == 3 and rows[:, 0].tolist() == [5, 9, 5]
    with pytest.raises(RingFrameError, match="3 frames"):
        decode_ring([bytes(f) for f in frames[:2]])
    with pytest.raises(RingFrameError, match="7 bytes of embedding rows for 2 token"):
        decode_ring([bytes(f) for f in frames[:2]] + [b"x" * 7])


def test_ring_messages_round_trip_without_copying_rows() -> None:
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    frames = encode_ring(ACT, rows)
    assert isinstance(frames[1], memoryview)
    msg, got = decode_ring([bytes(f) for f in frames])
    assert msg == ACT and np.array_equal(got, rows)
    with_inputs = ACT.__class__(**{**_fields(ACT), "per_layer": 3})  # Gemma 4 E2B: 1 hidden value, 3 per-layer
    assert decode_ring(encode_ring(with_inputs, rows))[0].per_layer == 3
    for m in (KvOp(proto=PROTOCOL_VERSION, epoch=7, step=4, op="remove", seq_id=0, p0=5),
              RingError(proto=PROTOCOL_VERSION, epoch=7, step=4, node="b", code="bad_message", message="x")):
        assert decode_ring(encode_ring(m)) == (m, None)


@pytest.mark.parametrize(("frames", "match"), [
    ([], "empty"),
    ([b"\xc1"], "malformed ring header"),
    (lambda: [encode_ring(ACT, np.zeros((2, 4), np.float32))[0]], "has 2 frames"),
    (lambda: [encode_ring(ACT, np.zeros((2, 4), np.float32))[0], b"\0" * 31], "31 bytes"),
    (lambda: encode_ring(ACT.__class__(**{**_fields(ACT), "dtype": "int32"}), np.zeros((2, 4), np.int32)),
     "width"),
    (lambda: encode_ring(ACT.__class__(**{**_fields(ACT), "parts": (Part(0, 10, 0),)}),
                         np.zeros((0, 4), np.float32)),
     "bad shape"),
    (lambda: encode_ring(ACT.__class__(**{**_fields(ACT), "parts": ()}), np.zeros((0, 4), np.float32)), "bad shape"),
    (lambda: encode_ring(ACT.__class__(**{**_fields(ACT), "parts": (Part(1, 0, 1), Part(1, 1, 1))}),
                         np.zeros((2, 4), np.float32)), "a sequence in two parts"),
    (lambda: encode_ring(ACT.__class__(**{**_fields(ACT), "per_layer": 4}), np.zeros((2, 4), np.float32)),
     "4 per-layer values in rows of width 4"),
    (lambda: encode_ring(ACT.__class__(**{**_fields(ACT), "per_layer": -1}), np.zeros((2, 4), np.float32)),
     "per-layer values"),
])
def test_malformed_ring_messages_are_refused(frames, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_ring(frames() if callable(frames) else frames)


def test_unknown_fields_are_ignored_and_wrong_types_refused() -> None:
    import msgspec

    raw = msgspec.msgpack.decode(encode(REQUESTS[0]))
    assert decode_request(msgspec.msgpack.encode({**raw, "future_field": 1})) == REQUESTS[0]
    with pytest.raises(ProtocolError, match="malformed control request"):
        decode_request(msgspec.msgpack.encode({**raw, "proto": "one"}))
    with pytest.raises(ProtocolError):
        decode_request(msgspec.msgpack.encode({"kind": "format_disk"}))


def test_a_head_tag_past_its_bounds_is_refused() -> None:
    """A node keeps the head that holds it and names it in every refusal: an id of 100000 characters (the fuzzer's,
    with take_over) once took a node from its head."""
    import msgspec

    raw = {"kind": "status", "head": {"id": "x" * 100000, "name": "h"}}
    with pytest.raises(ProtocolError, match="a head's id is 1 to 64 characters"):
        decode_request(msgspec.msgpack.encode(raw))
    for head in ({"id": "", "name": "h"}, {"id": "ab", "name": "n" * 2000}):
        with pytest.raises(ProtocolError, match="a head's id"):
            decode_request(msgspec.msgpack.encode({**raw, "head": head}))
    assert decode_request(msgspec.msgpack.encode({**raw, "head": {"id": "ab", "name": "h"}})).head.id == "ab"


def _fields(s) -> dict:
    import msgspec

    return msgspec.structs.asdict(s)


def test_a_header_that_does_not_validate_still_names_its_step() -> None:
    """So that a node's refusal answers that step (the head waits for it), not step -1, which it ignores."""
    import msgspec

    from primaplug.wire import RingFrameError

    header = msgspec.msgpack.decode(encode_ring(ACT, np.zeros((2, 4), np.float32))[0])
    with pytest.raises(RingFrameError, match="malformed ring header of step 3") as e:
        decode_ring([msgspec.msgpack.encode({**header, "width": "wide"}), b""])
    assert e.value.step == 3
    with pytest.raises(ProtocolError, match="malformed ring header") as e2:  # no step to name
        decode_ring([msgspec.msgpack.encode({**header, "step": "three"}), b""])
    assert not isinstance(e2.value, RingFrameError)
