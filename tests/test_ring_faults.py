"""Bad input on a real ring: malformed messages get error replies and the node keeps serving; CurveZMQ keeps peers
without the cluster key out. (A node killed mid-generation: tests/test_recovery.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.ring_helpers import LLAMA_KWARGS, greedy_scores

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def gemma_nodes(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory):
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 3, log_dir=tmp_path_factory.mktemp("fault-logs")) as local:
        yield local


# --- malformed messages ---------------------------------------------------------------------------------------

@pytest.fixture
def one_node_ring(gemma_nodes, gemma_path: Path):
    """node1 assigned layers [0, 6) of Gemma, its successor a socket of this test."""
    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.transport import ZmqTransport
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec

    layout = read_layout(gemma_path)
    t = ZmqTransport()  # closed whatever happens: a context left to the garbage collector can hang its worker
    try:
        client = NodeClient(t, gemma_nodes.addresses[0])
        client.hello()
        inbox = t.ring_in("127.0.0.1", 0)
        ident = ModelIdentity.of(layout, gemma_path.name)
        a = Assignment(epoch=42, model=ident, windows=(WindowSpec(0, 6),), successor=inbox.address, n_ctx=128,
                       n_batch=32, n_ubatch=32)
        client.load(a)
        while client.status().state != "ready":
            time.sleep(0.05)
        out = t.ring_out(client.welcome.ring_endpoint)
        yield client, out, inbox, a, layout
        client.release()  # the next test's head deploys at once
    finally:
        t.close()


def _act(seq_id: int = 0, n_rows: int = 3, **kw):
    from primaplug.wire import PROTOCOL_VERSION, Activation, Part

    base = dict(proto=PROTOCOL_VERSION, epoch=42, step=1, round=0, parts=(Part(seq_id, 0, n_rows, True),), width=1,
                dtype="int32")
    return Activation(**{**base, **kw})


def _kv(**kw):
    from primaplug.wire import PROTOCOL_VERSION, KvOp

    return KvOp(**{**dict(proto=PROTOCOL_VERSION, epoch=42, step=1, op="remove", seq_id=0, p0=0), **kw})


def _reply(inbox):
    from primaplug.wire import decode_ring

    frames = inbox.recv(10.0)
    assert frames is not None, "the node sent nothing on"
    return decode_ring(frames)


def test_malformed_ring_messages_get_error_replies(one_node_ring) -> None:
    import msgspec

    from primaplug.wire import Activation, RingError, encode_ring

    client, out, inbox, _, layout = one_node_ring
    tokens = np.array([2, 100, 200], dtype=np.int32)
    header, payload = encode_ring(_act(), tokens)
    bad = {
        "wrong version": [msgspec.msgpack.encode({**msgspec.msgpack.decode(header), "proto": 99}), payload],
        "header that does not validate": [msgspec.msgpack.encode({**msgspec.msgpack.decode(header), "round": "x"}),
                                          payload],
        "truncated buffer": [header, bytes(payload)[:-2]],
        "wrong row count": encode_ring(_act(n_rows=2), tokens[:2])[:1] + [payload],
        "unknown sequence": encode_ring(_act(seq_id=5), tokens),
        "stale assignment": encode_ring(_act(epoch=41), tokens),
        "hidden state of wrong width": encode_ring(_act(width=7, dtype="float32"), np.zeros((3, 7), np.float32)),
        "garbage": [b"\x00\xffnot msgpack", b"x"],
        "token out of vocabulary": encode_ring(_act(), np.array([2, 3, layout.n_vocab + 5], np.int32)),
        # llama.cpp asserts on these (it aborted the node): refused before they reach it
        "kv remove of sequence -2": encode_ring(_kv(seq_id=-2)),
        "kv remove of sequence 300": encode_ring(_kv(seq_id=300)),
        "kv remove of a negative span": encode_ring(_kv(p0=5, p1=2)),
    }
    expect = {"wrong version": "protocol 99", "header that does not validate": "malformed ring header of step 1",
              "truncated buffer": "bytes", "wrong row count": "bytes",
              "unknown sequence": "unknown sequence 5", "stale assignment": "assignment 41",
              "hidden state of wrong width": "takes token ids", "garbage": "malformed",
              "token out of vocabulary": "token ids must lie", "kv remove of sequence -2": "sequence -2",
              "kv remove of sequence 300": "sequences 0..0", "kv remove of a negative span": "positions [5, 2)"}
    for name, frames in bad.items():
        assert out.send(frames, 5.0)
        msg, _ = _reply(inbox)
        assert isinstance(msg, RingError), name
        assert msg.node == "node1" and expect[name] in msg.message, (name, msg.message)
    # the node still serves: a good message gets hidden states back, and the control channel answers
    assert out.send(encode_ring(_act(step=2), tokens), 5.0)
    msg, rows = _reply(inbox)
    assert isinstance(msg, Activation) and msg.step == 2 and rows.shape == (3, layout.n_embd)
    assert client.status().state == "ready"


def test_an_oversized_ring_frame_is_refused_without_holding_it(one_node_ring) -> None:
    """A frame larger than any batch (MAX_RING_MESSAGE_BYTES) disconnects its sender at the socket, before the node
    holds it; the node stays up and the next good message is served."""
    from primaplug.core.settings import MAX_RING_MESSAGE_BYTES
    from primaplug.wire import Activation, encode_ring

    client, out, inbox, _, layout = one_node_ring
    header, _ = encode_ring(_act(step=7), np.zeros(3, np.int32))
    assert out.send([header, bytes(MAX_RING_MESSAGE_BYTES + 1)], 5.0)
    assert inbox.recv(1.0) is None  # no answer: the frame never reached the node
    tokens = np.array([2, 100, 200], dtype=np.int32)
    deadline = time.monotonic() + 10
    while True:  # the sender reconnects, then the node serves as before
        assert out.send(encode_ring(_act(step=8), tokens), 5.0)
        frames = inbox.recv(1.0)
        if frames is not None or time.monotonic() > deadline:
            break
    assert frames is not None, "the node did not serve after refusing the oversized frame"
    from primaplug.wire import decode_ring

    msg, rows = decode_ring(frames)
    assert isinstance(msg, Activation) and msg.step == 8 and rows.shape == (3, layout.n_embd)
    assert client.status().state == "ready"


def test_bad_control_requests_get_error_replies(one_node_ring, gemma_path: Path) -> None:
    import msgspec

    from primaplug.core import NodeError
    from primaplug.wire import ErrorReply, ModelIdentity, WindowSpec, decode_reply

    client, _, _, a, _ = one_node_ring
    reply = decode_reply(client.client.request(b"\x93not a request", 5.0))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_message" and reply.node == "node1"
    other = ModelIdentity(identity="123:abc", file_name="llama-70b.gguf", n_layer=80, n_embd=8192)
    with pytest.raises(NodeError, match=r"llama-70b.gguf.*this node holds gemma") as e:
        client.load(msgspec.structs.replace(a, model=other))
    assert e.value.code == "wrong_model"
    with pytest.raises(NodeError, match=r"outside the model's layers"):
        client.load(msgspec.structs.replace(a, windows=(WindowSpec(10, 40),)))
    with pytest.raises(NodeError, match=r"100000 compute threads on a device of \d+ cores"):
        client.load(msgspec.structs.replace(a, n_threads=100000))
    with pytest.raises(NodeError, match=r"n_ubatch <= n_batch <= n_ctx"):
        client.load(msgspec.structs.replace(a, n_batch=4096))
    with pytest.raises(NodeError, match=r"at most 256"):
        client.load(msgspec.structs.replace(a, n_seq_max=1000))
    assert client.status().state == "ready"  # the refused loads changed nothing


# --- CurveZMQ -----------------------------------------------------------------------------------------------------

def test_curve_rejects_peers_without_the_cluster_key(gemma_path: Path, tmp_path: Path) -> None:
    import primaplug
    from primaplug.core import NodeUnavailableError
    from primaplug.head import NodeClient
    from primaplug.head.launch import LocalNodes
    from primaplug.transport import ZmqTransport, generate_keys

    key, stranger_key = tmp_path / "cluster.key", tmp_path / "stranger.key"
    generate_keys(key)
    generate_keys(stranger_key)
    from primaplug.transport import load_keys

    with LocalNodes(gemma_path, 2, log_dir=tmp_path / "logs", extra_args=["--keys", str(key)]) as local:
        for keys in (load_keys(stranger_key), None):  # a wrong key, and no encryption at all
            t = ZmqTransport(keys)
            client = NodeClient(t, local.addresses[0], timeout_s=1.5)
            with pytest.raises(NodeUnavailableError, match="did not answer"):
                client.hello()
            client.close()
            t.close()
        assert "rejected a peer" in local.nodes[0].log()

        ring = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", keys=key, node_threads=1,
                               **LLAMA_KWARGS)
        try:
            tokens, _ = greedy_scores(ring, ring.tokenize(b"Hello"), 4)
            assert len(tokens) == 4
        finally:
            ring.close()


def test_node_refuses_a_public_address_without_keys(gemma_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "primaplug", "node", "--model", str(gemma_path), "--listen",
                        "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "without encryption" in r.stderr and "primaplug keygen" in r.stderr


def test_keygen_writes_a_private_key_file(tmp_path: Path) -> None:
    from primaplug.core import ConfigError
    from primaplug.transport import generate_keys, load_keys

    path = tmp_path / "c.key"
    keys = generate_keys(path)
    assert load_keys(path) == keys and (path.stat().st_mode & 0o777) == 0o600
    assert "secret" not in repr(keys) and keys.secret.decode() not in repr(keys)
    with pytest.raises(ConfigError, match="exists"):
        generate_keys(path)
