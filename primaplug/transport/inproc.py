"""The in-process transport: the same sockets as ZmqTransport, made of queues, for tests and for a device that
plays two roles in one process.

Every InprocTransport made with the same InprocNetwork reaches the endpoints the others bind; there is no
module-wide network, so two tests never see each other's sockets. The semantics are ZeroMQ's, as the ring and
the head rely on them:

- control (DEALER/ROUTER): send() returns a request id and never waits; take_reply(rid) drops the replies to
  older requests; requests to an endpoint nobody listens on yet wait for a server to bind it.
- ring (PUSH/PULL with `immediate`): a send waits at most its timeout for a bound receiver with room in its
  queue (high-water mark 64 messages) and returns False otherwise, so nothing is queued for an absent peer.
  Frames are copied when sent, so a receiver never sees the sender change its buffers afterwards.

One lock (and one condition) guards the whole network: its users are a handful of threads, and a single lock
keeps every hand-over (bind, deliver, close) obviously atomic.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from primaplug.core.errors import ConfigError
from primaplug.transport.addresses import WILDCARD_HOSTS, endpoint, parse_endpoint
from primaplug.transport.base import Frames
from primaplug.transport.keys import ClusterKeys

RING_HWM = 64  # messages a ring input holds before sends wait (ZmqTransport's sndhwm)
_FIRST_PORT = 49152  # port 0 binds count up from the start of the usual ephemeral range
_S = TypeVar("_S", bound="_InprocSocket")


@dataclass
class _Request:
    client: bytes  # the identity of the client that sent it, as a ROUTER envelope carries it
    rid: bytes
    body: bytes


class InprocNetwork:
    """The endpoints that the InprocTransports made with it share: make one per test (or per process)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.bound: dict[tuple[str, int], _BoundSocket] = {}
        self.clients: dict[bytes, InprocControlClient] = {}
        self.waiting: dict[str, list[_Request]] = {}  # requests to endpoints that no server has bound yet
        self._ports = itertools.count(_FIRST_PORT)
        self._client_ids = itertools.count(1)

    # all methods below run with self.cv held

    def _port_in_use(self, port: int) -> bool:
        return any(p == port for _, p in self.bound)

    def _bind(self, sock: _BoundSocket, host: str, port: int) -> str:
        if port == 0:
            port = next(p for p in self._ports if not self._port_in_use(p))
        # like TCP: a wildcard bind takes the port on every host, so it clashes with any bind of that port
        clash = [(h, p) for h, p in self.bound if p == port and (h == host or {h, host} & WILDCARD_HOSTS)]
        if clash:
            raise ConfigError(f"cannot listen on {host}:{port}: the address is in use (by {endpoint(*clash[0])})")
        self.bound[(host, port)] = sock
        address = endpoint(host, port)
        if isinstance(sock, InprocControlServer):  # requests that waited for this server reach it now
            for to in list(self.waiting):
                if self._lookup(to) is sock:
                    sock.inbox.extend(self.waiting.pop(to))
        self.cv.notify_all()
        return address

    def _unbind(self, sock: _BoundSocket) -> None:
        for key, s in list(self.bound.items()):
            if s is sock:
                del self.bound[key]
        self.cv.notify_all()

    def _lookup(self, address: str) -> _BoundSocket | None:
        """The socket a connection to this endpoint reaches: one bound on that host, else one on a wildcard."""
        host, port = parse_endpoint(address)
        sock = self.bound.get((host, port)) or (self.bound.get(("127.0.0.1", port)) if host == "localhost" else None)
        if sock is None:
            sock = next((s for (h, p), s in self.bound.items() if p == port and h in WILDCARD_HOSTS), None)
        return sock


class InprocTransport:
    """Makes in-process sockets on a network. `keys` is kept for the callers that check it (a head refuses
    nodes beyond loopback without keys); nothing is encrypted, as nothing leaves the process."""

    def __init__(self, network: InprocNetwork, keys: ClusterKeys | None = None) -> None:
        self.network, self.keys = network, keys
        self._sockets: list[_InprocSocket] = []
        self._closed = False

    def _made(self, make: Callable[[], _S]) -> _S:
        if self._closed:  # as with a terminated zmq context
            raise RuntimeError("this InprocTransport is closed")
        sock = make()
        self._sockets = [s for s in self._sockets if not s.closed]  # forget the ones closed already
        self._sockets.append(sock)
        return sock

    def control_server(self, host: str, port: int) -> InprocControlServer:
        return self._made(lambda: InprocControlServer(self.network, host, port))

    def control_client(self, address: str) -> InprocControlClient:
        return self._made(lambda: InprocControlClient(self.network, address))

    def ring_in(self, host: str, port: int) -> InprocRingIn:
        return self._made(lambda: InprocRingIn(self.network, host, port))

    def ring_out(self, address: str) -> InprocRingOut:
        return self._made(lambda: InprocRingOut(self.network, address))

    def close(self) -> None:
        self._closed = True
        for s in self._sockets:
            s.close()
        self._sockets.clear()


class _InprocSocket:
    def __init__(self, network: InprocNetwork, address: str) -> None:
        self.network, self.address = network, address
        self.closed = False

    def close(self) -> None:
        raise NotImplementedError

    def _check(self) -> None:  # with the lock held
        if self.closed:
            raise RuntimeError(f"socket {self.address} is closed")

    def _wait(self, ready: Callable[[], object], timeout_s: float) -> bool:
        """Wait (lock held) until ready() is true or the timeout passes; a timeout of 0 only looks."""
        return bool(self.network.cv.wait_for(ready, max(0.0, timeout_s)))


class _BoundSocket(_InprocSocket):
    """A socket bound to an address (a control server, a ring input): what it is sent waits in its inbox."""

    def __init__(self, network: InprocNetwork, host: str, port: int) -> None:
        super().__init__(network, "")
        self.inbox: deque[Any] = deque()
        with network.cv:
            self.address = network._bind(self, host, port)

    def _take(self, timeout_s: float) -> Any:
        """The next message in the inbox (lock held), or None after the timeout or once closed."""
        self._check()
        if not self._wait(lambda: self.inbox or self.closed, timeout_s) or self.closed:
            return None
        return self.inbox.popleft()

    def close(self) -> None:
        with self.network.cv:
            if not self.closed:
                self.closed = True
                self.inbox.clear()  # what it had not read dies with it
                self.network._unbind(self)


class InprocControlServer(_BoundSocket):
    def recv(self, timeout_s: float) -> tuple[list[bytes], bytes] | None:
        with self.network.cv:
            req: _Request | None = self._take(timeout_s)
            return None if req is None else ([req.client, req.rid], req.body)

    def reply(self, envelope: list[bytes], body: bytes) -> None:
        client_id, rid = envelope
        with self.network.cv:
            self._check()
            client = self.network.clients.get(client_id)
            if client is not None:  # like a ROUTER, drop replies to clients that have gone
                client.inbox.append((rid, bytes(body)))
                self.network.cv.notify_all()


class InprocControlClient(_InprocSocket):
    def __init__(self, network: InprocNetwork, address: str) -> None:
        parse_endpoint(address)  # a malformed endpoint fails here, as zmq's connect() does
        super().__init__(network, address)
        self.inbox: deque[tuple[bytes, bytes]] = deque()
        self._ids = itertools.count(1)
        with network.cv:
            self.identity = next(network._client_ids).to_bytes(4, "big")
            network.clients[self.identity] = self

    def send(self, body: bytes) -> int:
        rid = next(self._ids)
        req = _Request(self.identity, rid.to_bytes(8, "little"), bytes(body))
        with self.network.cv:
            self._check()
            server = self.network._lookup(self.address)
            if isinstance(server, InprocControlServer):
                server.inbox.append(req)
                self.network.cv.notify_all()
            elif server is None:  # like a DEALER, queue for a server that is not listening yet
                self.network.waiting.setdefault(self.address, []).append(req)
            # else a ring input listens there: like ZeroMQ's mismatched socket types, it is never answered
        return rid

    def take_reply(self, rid: int, timeout_s: float) -> bytes | None:
        want = rid.to_bytes(8, "little")
        deadline = time.monotonic() + timeout_s
        with self.network.cv:
            self._check()
            while self._wait(lambda: self.inbox or self.closed, deadline - time.monotonic()) and not self.closed:
                got, body = self.inbox.popleft()
                if got == want:
                    return body
        return None

    def request(self, body: bytes, timeout_s: float) -> bytes | None:
        return self.take_reply(self.send(body), timeout_s)

    def close(self) -> None:
        with self.network.cv:
            if not self.closed:
                self.closed = True
                self.network.clients.pop(self.identity, None)
                for to, reqs in list(self.network.waiting.items()):  # unsent requests go with it (linger 0)
                    reqs[:] = [r for r in reqs if r.client != self.identity]
                    if not reqs:
                        del self.network.waiting[to]
                self.network.cv.notify_all()


class InprocRingIn(_BoundSocket):
    def recv(self, timeout_s: float) -> Frames | None:
        with self.network.cv:
            frames: list[bytes] | None = self._take(timeout_s)
            if frames is None:
                return None
            self.network.cv.notify_all()  # a sender may be waiting for room
            return list(frames)


class InprocRingOut(_InprocSocket):
    def __init__(self, network: InprocNetwork, address: str) -> None:
        parse_endpoint(address)  # a malformed endpoint fails here, as zmq's connect() does
        super().__init__(network, address)

    def send(self, frames: Sequence[bytes | memoryview], timeout_s: float) -> bool:
        msg = [bytes(f) for f in frames]  # copied now: the caller may reuse its buffers once send returns

        def room() -> InprocRingIn | None:
            target = self.network._lookup(self.address)
            if isinstance(target, InprocRingIn) and len(target.inbox) < RING_HWM:
                return target
            return None

        with self.network.cv:
            self._check()
            if not self._wait(room, timeout_s):
                return False
            target = room()
            assert target is not None  # the lock has been held since room() said so
            target.inbox.append(msg)
            self.network.cv.notify_all()
            return True

    def close(self) -> None:
        with self.network.cv:
            self.closed = True

