"""The ZeroMQ transport: the sockets of a device over TCP, made by one ZmqTransport per process.

Control: a node binds a ROUTER, the head talks to it through a DEALER, one reply per request, matched by a
request id so that a late reply to a timed-out request is never taken for the answer to the next one.
Ring: every device binds a PULL and PUSHes to its successor's PULL. Sends never block longer than their
timeout and never queue for a peer that is not connected, so a dead successor shows up as an error.
With cluster keys, every socket speaks CurveZMQ and bound sockets admit only holders of the key.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

import zmq
import zmq.auth.thread
import zmq.utils.monitor

from primaplug.core.errors import ConfigError
from primaplug.core.settings import MAX_CONTROL_MESSAGE_BYTES, MAX_RING_MESSAGE_BYTES
from primaplug.transport.addresses import endpoint, is_loopback, split_address
from primaplug.transport.base import Frames
from primaplug.transport.keys import ClusterKeys

log = logging.getLogger(__name__)

# the address helpers lived here first; importing them from this module still works
__all__ = ["ZmqControlClient", "ZmqControlServer", "ZmqRingIn", "ZmqRingOut", "ZmqTransport", "endpoint",
           "is_loopback", "split_address"]


REJECTIONS_LOG_S = 60.0  # a peer turned away again within this time is counted, not logged again


class _Rejections:
    """Logs a refusal once per kind and interval, then how many more there were: a peer that keeps retrying (ZeroMQ
    reconnects every 100 ms) must not fill the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (when it was last logged, refusals since)

    def note(self, what: str, key: str | None = None) -> None:
        """Logs `what` unless the same `key` (by default `what` itself) was logged within the interval."""
        now = time.monotonic()
        key = key or what
        with self._lock:
            last, more = self._seen.get(key, (-REJECTIONS_LOG_S, 0))
            if now - last < REJECTIONS_LOG_S:
                self._seen[key] = (last, more + 1)
                return
            self._seen[key] = (now, 0)
        again = f" ({more} more time(s) in the last {REJECTIONS_LOG_S:.0f} s)" if more else ""
        log.warning("%s%s (give it the cluster key file made by `primaplug keygen`)", what, again)


_REJECTIONS = _Rejections()


class _KeyCheck:
    """ZAP callback: lets in only clients that hold the cluster key, and logs the others."""

    def __init__(self, keys: ClusterKeys) -> None:
        self.public = keys.public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = zmq.utils.z85.encode(key) == self.public if len(key) == 32 else key == self.public
        if not ok:
            peer = zmq.utils.z85.encode(key).decode()[:8] if len(key) == 32 else str(key)[:8]
            _REJECTIONS.note(f"rejected a peer holding key {peer}...: not this cluster's key")
        return ok


_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: it does not speak CurveZMQ with the cluster key",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
}


class _HandshakeLog(threading.Thread):
    """Logs the peers a Curve server socket turns away before they reach the key check (wrong server key, or
    no encryption at all): libzmq drops them silently otherwise."""

    def __init__(self, sock: zmq.Socket, address: str) -> None:
        super().__init__(name=f"handshake-log {address}", daemon=True)
        self.sock, self.address = sock, address
        self.monitor = sock.get_monitor_socket(sum(_HANDSHAKE_FAILED))
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.monitor.poll(200):
                event = zmq.utils.monitor.recv_monitor_message(self.monitor)
                why = _HANDSHAKE_FAILED.get(event["event"])
                if why:  # libzmq names only this socket's endpoint, not the peer's; a retrying peer's first
                    # handshake fails with a reason, the later ones often with none: one key per endpoint
                    _REJECTIONS.note(f"rejected a peer connecting to {self.address}: {why}", key=self.address)
        self.monitor.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(2)


class ZmqTransport:
    """Owns the ZeroMQ context; every socket of the process comes from here.

    With keys, every bound socket is a CurveZMQ server that admits only holders of the cluster key, and every
    connecting socket authenticates with it; without keys, traffic is plain TCP (for loopback).
    """

    def __init__(self, keys: ClusterKeys | None = None) -> None:
        self.keys = keys
        self.ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._monitors: list[_HandshakeLog] = []

    def _server(self, sock: zmq.Socket) -> None:
        if self.keys is None:
            return
        if self._auth is None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self.ctx, log=logging.getLogger(__name__ + ".zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=_KeyCheck(self.keys))
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def _client(self, sock: zmq.Socket) -> None:
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_serverkey = self.keys.public

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        return sock

    def _bind(self, sock: zmq.Socket, host: str, port: int) -> int:
        self._server(sock)
        try:
            if port == 0:
                port = sock.bind_to_random_port(endpoint(host, 0).rsplit(":", 1)[0])
            else:
                sock.bind(endpoint(host, port))
        except zmq.ZMQError as e:
            sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        if self.keys is not None:
            self._monitors.append(_HandshakeLog(sock, endpoint(host, port)))
        return port

    def control_server(self, host: str, port: int) -> ZmqControlServer:
        sock = self._socket(zmq.ROUTER)
        sock.maxmsgsize = MAX_CONTROL_MESSAGE_BYTES
        port = self._bind(sock, host, port)
        return ZmqControlServer(sock, endpoint(host, port))

    def control_client(self, address: str) -> ZmqControlClient:
        sock = self._socket(zmq.DEALER)
        sock.maxmsgsize = MAX_CONTROL_MESSAGE_BYTES
        self._client(sock)
        sock.connect(address)
        return ZmqControlClient(sock, address)

    def ring_in(self, host: str, port: int) -> ZmqRingIn:
        sock = self._socket(zmq.PULL)
        sock.maxmsgsize = MAX_RING_MESSAGE_BYTES  # a larger frame disconnects its sender instead of filling memory
        port = self._bind(sock, host, port)
        return ZmqRingIn(sock, endpoint(host, port))

    def ring_out(self, address: str) -> ZmqRingOut:
        sock = self._socket(zmq.PUSH)
        sock.immediate = True  # queue nothing for a successor that is not connected
        sock.sndhwm = 64
        self._client(sock)
        sock.connect(address)
        return ZmqRingOut(sock, address)

    def close(self) -> None:
        for m in self._monitors:
            m.stop()
        self._monitors.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.destroy(linger=0)  # closes any socket an error path left open, instead of waiting for it


class ZmqControlServer:
    def __init__(self, sock: zmq.Socket, address: str) -> None:
        self.sock, self.address = sock, address

    def recv(self, timeout_s: float) -> tuple[list[bytes], bytes] | None:
        """(envelope, request body), or None after the timeout. The envelope goes back with the reply."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        return frames[:-1], frames[-1]

    def reply(self, envelope: list[bytes], body: bytes) -> None:
        self.sock.send_multipart([*envelope, body])

    def close(self) -> None:
        self.sock.close()


class ZmqControlClient:
    def __init__(self, sock: zmq.Socket, address: str) -> None:
        self.sock, self.address = sock, address
        self._ids = itertools.count(1)

    def send(self, body: bytes) -> int:
        """Send a request without waiting; returns its id for take_reply()."""
        rid = next(self._ids)
        self.sock.send_multipart([rid.to_bytes(8, "little"), body])
        return rid

    def take_reply(self, rid: int, timeout_s: float) -> bytes | None:
        """The reply to request `rid`, or None if none came within the timeout. Older replies are dropped."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = self.sock.recv_multipart()
            if len(frames) == 2 and int.from_bytes(frames[0], "little") == rid:
                return frames[1]
        return None

    def request(self, body: bytes, timeout_s: float) -> bytes | None:
        return self.take_reply(self.send(body), timeout_s)

    def close(self) -> None:
        self.sock.close()


class ZmqRingIn:
    def __init__(self, sock: zmq.Socket, address: str) -> None:
        self.sock, self.address = sock, address

    def recv(self, timeout_s: float) -> Frames | None:
        """The frames of the next ring message (zero-copy buffers), or None after the timeout."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return [f.buffer for f in self.sock.recv_multipart(copy=False)]

    def close(self) -> None:
        self.sock.close()


class ZmqRingOut:
    def __init__(self, sock: zmq.Socket, address: str) -> None:
        self.sock, self.address = sock, address

    def send(self, frames: Sequence[bytes | memoryview], timeout_s: float) -> bool:
        """Send one ring message; False if the successor could not take it within the timeout."""
        self.sock.sndtimeo = int(timeout_s * 1000)
        try:
            self.sock.send_multipart(list(frames), copy=False)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.sock.close()
