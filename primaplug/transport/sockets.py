"""The ZeroMQ transport: the sockets of a device over TCP, made by one ZmqTransport per process.

Control: a node binds a ROUTER, the head talks to it through a DEALER, one reply per request, matched by a
request id so that a late reply to a timed-out request is never taken for the answer to the next one.
Ring: every device binds a PULL and PUSHes to its successor's PULL. Sends never block longer than their
timeout and never queue for a peer that is not connected, so a dead successor shows up as an error.
With cluster keys, every socket speaks CurveZMQ and bound sockets admit only holders of the key.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

import zmq

from primaplug.core.errors import ConfigError
from primaplug.core.settings import MAX_CONTROL_MESSAGE_BYTES, MAX_RING_MESSAGE_BYTES
from primaplug.transport.addresses import endpoint, is_loopback, split_address
from primaplug.transport.base import Frames
from primaplug.transport.keys import ClusterKeys
from primaplug.transport.zap import KeyGate

log = logging.getLogger(__name__)

# the address helpers lived here first; importing them from this module still works
__all__ = ["ZmqControlClient", "ZmqControlServer", "ZmqRingIn", "ZmqRingOut", "ZmqTransport", "endpoint",
           "is_loopback", "split_address"]


REJECTIONS_LOG_S = 60.0  # a peer turned away again within this time is counted, not logged again
_REJECTIONS_KEPT = 64  # peers remembered (and lines logged) per interval; the rest of a crowd shares one line


class _Rejections:
    """Logs a refused peer once per interval, then how many more times it was refused: a peer that keeps retrying
    (ZeroMQ reconnects every 100 ms) must not fill the log, and a crowd of them must not fill memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[str, tuple[float, int]] = {}  # peer (or "?endpoint") -> (when logged, refusals since)
        self._last_on: dict[str, str] = {}  # endpoint -> the key of the last line logged for it

    def note(self, why: str, peer: str | None, where: str | None = None) -> None:
        """A refusal of `peer` (its IP address; None where it could not be read) connecting to `where` (this side's
        endpoint, where known)."""
        now = time.monotonic()
        with self._lock:
            # a refusal whose peer could not be named counts toward the line already logged for the endpoint; so does
            # a named one after an unnamed line there (a retrying peer whose first address was lost): one line each
            folds = [peer] if peer else []
            last = self._last_on.get(where or "")
            if last is not None and (peer is None or last.startswith("?")):
                folds.append(last)
            for key in folds:
                at, more = self._lines.get(key, (-REJECTIONS_LOG_S, 0))
                if now - at < REJECTIONS_LOG_S:
                    self._lines[key] = (at, more + 1)
                    return
            key = peer or f"?{where}"
            crowd = False
            if key not in self._lines and len(self._lines) >= _REJECTIONS_KEPT:
                self._lines = {k: v for k, v in self._lines.items() if now - v[0] < REJECTIONS_LOG_S}
                self._last_on = {w: k for w, k in self._last_on.items() if k in self._lines}
                if len(self._lines) >= _REJECTIONS_KEPT:  # that many peers within one interval: one line for the rest
                    at, more = self._lines.get("+", (-REJECTIONS_LOG_S, 0))
                    if now - at < REJECTIONS_LOG_S:
                        self._lines["+"] = (at, more + 1)
                        return
                    key, crowd = "+", True
            more = self._lines.get(key, (0.0, 0))[1]
            self._lines[key] = (now, 0)
            if where and not crowd:
                self._last_on[where] = key
        who = f"a peer at {peer}" if peer else "a peer whose address was gone before it could be read"
        who += f" (more than {_REJECTIONS_KEPT} peers refused within {REJECTIONS_LOG_S:.0f} s)" if crowd else ""
        to = f" connecting to {where}" if where else ""
        again = f" ({more} more time(s) in the last {REJECTIONS_LOG_S:.0f} s)" if more else ""
        log.warning("rejected %s%s: %s%s (give it the cluster key file made by `primaplug keygen`)", who, to, why,
                    again)


# refusals libzmq makes before the key check; the key check (ZAP) logs its own, with the key (an "auth" failure)
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: it does not speak CurveZMQ with the cluster key",
}
_MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | sum(_HANDSHAKE_FAILED)


def _peer_of(fd: int) -> str | None:
    """The IP address at the other end of socket `fd` (libzmq's), or None when it is closed or not a socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with sock:
        try:
            return str(sock.getpeername()[0])
        except (OSError, IndexError):
            return None


class _HandshakeLog(threading.Thread):
    """Logs the peers a Curve server socket turns away before they reach the key check (wrong server key, or
    no encryption at all): libzmq drops them silently otherwise.

    libzmq's monitor events (without its draft API, as pyzmq ships it) name only this socket's endpoint, never the
    peer. The peer is read with getpeername on the file descriptor an ACCEPTED event carries, while the connection is
    still open; a failed handshake is reported just before the DISCONNECTED event of its connection (one I/O thread
    sends both), which names that descriptor. A peer that does not speak CurveZMQ at all is refused at its greeting,
    often before this thread has read the ACCEPTED event: its address is gone by then, and the line says so.
    """

    def __init__(self, sock: zmq.Socket, address: str, rejections: _Rejections) -> None:
        super().__init__(name=f"handshake-log {address}", daemon=True)
        self.sock, self.address, self.rejections = sock, address, rejections
        self.monitor = sock.get_monitor_socket(_MONITORED)
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        queued: collections.deque[dict] = collections.deque()
        peers: dict[int, str | None] = {}  # descriptor -> the peer of each connection accepted and not yet closed
        failed = ""  # why the handshake of the connection whose DISCONNECTED comes next failed
        while not self.stopping.is_set():
            event = queued.popleft() if queued else self._next(200)
            if event is None:
                continue
            kind, value = event["event"], event["value"]
            if failed and kind != zmq.EVENT_DISCONNECTED:  # not the pairing expected: say it without a peer
                self.rejections.note(failed, None, self.address)
                failed = ""
            if kind == zmq.EVENT_ACCEPTED:
                peer = _peer_of(value)
                while (more := self._next(0)) is not None:
                    queued.append(more)
                # libzmq reports DISCONNECTED before it closes the descriptor: if one is already queued, the number
                # may have been closed and given to another socket before getpeername read it
                gone = any(e["event"] == zmq.EVENT_DISCONNECTED and e["value"] == value for e in queued)
                peers[value] = None if gone else peer
            elif kind in _HANDSHAKE_FAILED:
                failed = _HANDSHAKE_FAILED[kind]
            elif kind == zmq.EVENT_DISCONNECTED:
                peer = peers.pop(value, None)
                if failed:
                    self.rejections.note(failed, peer, self.address)
                    failed = ""
        self.monitor.close()

    def _next(self, timeout_ms: int) -> dict | None:
        """The next event, read as zmq.utils.monitor would (whose import brings asyncio: transport/zap.py): a
        16-bit event id and a 32-bit value, then the endpoint."""
        if not self.monitor.poll(timeout_ms):
            return None
        head, where = self.monitor.recv_multipart()
        kind, value = struct.unpack("=Hi", head)
        return {"event": kind, "value": value, "endpoint": where}

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
        self._gate: KeyGate | None = None
        self._monitors: list[_HandshakeLog] = []
        self._rejections = _Rejections()  # one log of refused peers for all the sockets of this transport

    def _server(self, sock: zmq.Socket) -> None:
        if self.keys is None:
            return
        if self._gate is None:
            self._gate = KeyGate(self.ctx, self.keys.public, lambda why, peer: self._rejections.note(why, peer or None))
            self._gate.start()
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
            self._monitors.append(_HandshakeLog(sock, endpoint(host, port), self._rejections))
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
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
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
