"""ZeroMQ sockets with the cluster key, on loopback: a peer turned away over and over is logged once per interval,
not once per reconnection (libzmq retries every 100 ms), and the line names the peer."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit


def test_a_peer_that_keeps_retrying_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from primaplug.transport import ZmqTransport, generate_keys

    server = ZmqTransport(generate_keys(tmp_path / "cluster.key"))
    plain = ZmqTransport()  # no encryption: the handshake fails, again at every reconnection
    try:
        inbox = server.ring_in("127.0.0.1", 0)
        with caplog.at_level(logging.WARNING, logger="primaplug.transport.sockets"):
            out = plain.ring_out(inbox.address)
            out.send([b"x"], 0.2)
            time.sleep(1.5)
        refused = [r.getMessage() for r in caplog.records if "rejected a peer" in r.getMessage()]
        assert len(refused) == 1, refused
        assert f"connecting to {inbox.address}" in refused[0] and "primaplug keygen" in refused[0]
        # libzmq refuses a peer without encryption at its greeting, often before its address can be read: the line
        # names it, or says that it could not (transport/sockets.py: _HandshakeLog)
        assert "a peer at 127.0.0.1 " in refused[0] or "address was gone" in refused[0], refused[0]
        assert inbox.recv(0.1) is None  # and nothing got through
        out.close()
        inbox.close()
    finally:
        plain.close()
        server.close()


def test_a_peer_with_another_key_is_named_once_for_all_its_connections(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A peer that knows the cluster's public key (it is no secret) but holds a key pair of its own reaches the key
    check, which names it by address; its retries on two sockets make one line."""
    from primaplug.transport import ZmqTransport, generate_keys

    cluster = generate_keys(tmp_path / "cluster.key")

    class KnowsThePublicKey(ZmqTransport):
        def _client(self, sock: Any) -> None:
            super()._client(sock)
            sock.curve_serverkey = cluster.public

    server = ZmqTransport(cluster)
    stranger = KnowsThePublicKey(generate_keys(tmp_path / "stranger.key"))
    try:
        control, inbox = server.control_server("127.0.0.1", 0), server.ring_in("127.0.0.1", 0)
        with caplog.at_level(logging.WARNING, logger="primaplug.transport.sockets"):
            client, out = stranger.control_client(control.address), stranger.ring_out(inbox.address)
            client.send(b"hello?")
            out.send([b"x"], 0.2)
            time.sleep(1.5)
        refused = [r.getMessage() for r in caplog.records if "rejected a peer" in r.getMessage()]
        assert len(refused) == 1, refused
        assert "a peer at 127.0.0.1: it holds key" in refused[0] and "not this cluster's" in refused[0], refused[0]
        assert control.recv(0.1) is None and inbox.recv(0.1) is None
        for s in (client, out, control, inbox):
            s.close()
    finally:
        stranger.close()
        server.close()


def test_refusals_are_logged_once_per_peer_and_interval(caplog: pytest.LogCaptureFixture) -> None:
    from primaplug.transport.sockets import _REJECTIONS_KEPT, _Rejections

    rejections = _Rejections()
    with caplog.at_level(logging.WARNING, logger="primaplug.transport.sockets"):
        rejections.note("handshake failed", None, "tcp://127.0.0.1:7001")  # its address was gone
        rejections.note("handshake failed", "10.0.0.5", "tcp://127.0.0.1:7001")  # the same peer retrying: counted
        rejections.note("handshake failed", "10.0.0.5", "tcp://127.0.0.1:7000")  # named at last
        rejections.note("handshake failed", "10.0.0.5", "tcp://127.0.0.1:7001")
        rejections.note("bad key", "10.0.0.6")  # another peer
        rejections.note("bad key", "10.0.0.6")
        for i in range(1000):  # a crowd of addresses: a line each until the interval's memory is full, then one
            rejections.note("bad key", f"fd00::{i:x}")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == _REJECTIONS_KEPT + 1, lines[:5]
    assert "address was gone" in lines[0] and "tcp://127.0.0.1:7001" in lines[0]
    assert "a peer at 10.0.0.5 connecting to tcp://127.0.0.1:7000" in lines[1]
    assert "a peer at 10.0.0.6: bad key" in lines[2] and "a peer at fd00::0:" in lines[3]
    assert f"more than {_REJECTIONS_KEPT} peers refused" in lines[-1]
    assert len(rejections._lines) <= _REJECTIONS_KEPT + 1


def test_a_key_holder_gets_through_and_no_asyncio_is_loaded(tmp_path: Path) -> None:
    """The key check is primaplug's own ZAP thread (transport/zap.py): pyzmq's runs on asyncio, whose import took
    1.5-2 MiB of every node and head. In a fresh process, with keys, a holder of the cluster key reaches the server
    on both kinds of socket, and neither asyncio nor ssl is loaded."""
    import subprocess
    import sys

    from primaplug.transport import generate_keys

    generate_keys(tmp_path / "cluster.key")
    probe = (
        "import sys\n"
        "from primaplug.transport import ZmqTransport, load_keys\n"
        "keys = load_keys(sys.argv[1])\n"
        "server, client = ZmqTransport(keys), ZmqTransport(keys)\n"
        "inbox, control = server.ring_in('127.0.0.1', 0), server.control_server('127.0.0.1', 0)\n"
        "out, asker = client.ring_out(inbox.address), client.control_client(control.address)\n"
        "out.send([b'row'], 5.0)\n"
        "asker.send(b'hello')\n"
        "got = inbox.recv(5.0)\n"
        "asked = control.recv(5.0)\n"
        "print(got is not None and list(got) == [b'row'], asked is not None,\n"
        "      sorted({'asyncio', 'ssl'} & set(sys.modules)))\n"
        "for s in (out, asker, inbox, control):\n"
        "    s.close()\n"
        "client.close(); server.close()\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "cluster.key")], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split("\n")[0] == "True True []", out.stdout + out.stderr


def test_the_key_check_answers_what_libzmq_asks() -> None:
    """ZAP (RFC 27): a CURVE request with the cluster key is admitted with 200, another key or mechanism or a
    malformed request is refused with 400, and each refusal is reported with the peer's address."""
    import zmq

    from primaplug.transport.zap import KeyGate

    secret_public, secret = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    refused: list[tuple[str, str]] = []
    ctx = zmq.Context()
    gate = KeyGate(ctx, secret_public, lambda why, peer: refused.append((why, peer)))
    try:
        def ask(mechanism: bytes, *credentials: bytes) -> list[bytes]:
            return gate.answer([b"1.0", b"7", b"", b"10.0.0.9", b"", mechanism, *credentials])

        assert ask(b"CURVE", zmq.utils.z85.decode(secret_public))[:3] == [b"1.0", b"7", b"200"]
        assert ask(b"CURVE", zmq.utils.z85.decode(other_public))[2] == b"400"
        assert ask(b"NULL")[2] == b"400"
        assert gate.answer([b"2.0", b"8"])[:3] == [b"1.0", b"8", b"400"]
        assert [peer for _, peer in refused] == ["10.0.0.9", "10.0.0.9"]
        assert "not this cluster's" in refused[0][0] and "does not speak CurveZMQ" in refused[1][0]
    finally:
        gate.sock.close()
        ctx.term()
