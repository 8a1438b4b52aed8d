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
