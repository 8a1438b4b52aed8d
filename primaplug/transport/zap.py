"""The key check of a CurveZMQ server: a ZAP handler (ZeroMQ RFC 27) that admits only holders of the cluster key.

libzmq asks the handler bound at `inproc://zeromq.zap.01` of the socket's context about every CurveZMQ handshake,
with the client's public key. pyzmq's own handler (zmq.auth.thread) runs on asyncio, whose import (ssl with it)
held 1.5-2 MiB of anonymous memory in every node and head, taken from the apps on the device, whether or not the
ring ever leaves the machine (5.9 MiB in a bare interpreter, less in a node that loads some of the same modules
anyway; benchmarks/results/LOG.md, 2026-11-29). This one is a thread on a plain socket, started only when the
process has keys.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq
import zmq.utils.z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq looks for the handler (RFC 27)
_POLL_MS = 100  # how often the thread looks at its stop flag between requests


class KeyGate(threading.Thread):
    """Answers ZAP requests in `ctx`: a CURVE client whose public key is `public` (Z85) is let in, anyone else is
    refused, and `refused(why, peer_address)` is told so (the address as libzmq gives it, "" where it has none)."""

    def __init__(self, ctx: zmq.Context, public: bytes, refused: Callable[[str, str], None]) -> None:
        super().__init__(name="zap key check", daemon=True)
        self.public, self.refused = public, refused
        self.stopping = threading.Event()
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)  # before any server socket binds: without a handler libzmq admits every key

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.sock.poll(_POLL_MS):
                    self.sock.send_multipart(self.answer(self.sock.recv_multipart()))
        finally:
            self.sock.close()

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one request: version, request id, status code and text, user id, metadata (RFC 27)."""
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        request_id, address, mechanism, credentials = request[1], request[3], request[5], request[6:]
        peer = address.decode("utf-8", "replace")
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self.refused(f"it does not speak CurveZMQ (mechanism {mechanism.decode('ascii', 'replace')})", peer)
            return [b"1.0", request_id, b"400", b"CURVE only", b"", b""]
        key = zmq.utils.z85.encode(credentials[0])
        if key != self.public:
            self.refused(f"it holds key {key.decode('ascii', 'replace')[:8]}..., not this cluster's", peer)
            return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", b"", b""]

    def stop(self) -> None:
        self.stopping.set()
        self.join(2 * _POLL_MS / 1000 + 1)
