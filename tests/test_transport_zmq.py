"""ZeroMQ sockets with the cluster key, on loopback: a peer turned away over and over is logged once per interval,
not once per reconnection (libzmq retries every 100 ms)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

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
        assert inbox.recv(0.1) is None  # and nothing got through
        out.close()
        inbox.close()
    finally:
        plain.close()
        server.close()
