"""The transport seam: the sockets a device uses, as protocols, so that the ring logic runs over ZeroMQ in
production and over in-process queues (with injected faults) in tests.

Two channels, each with the semantics of the ZeroMQ sockets that first implemented them:

- control: a node serves requests (ROUTER), the head asks (DEALER). One reply per request, matched by a
  request id, so that a late reply to a timed-out request is never taken for the answer to the next one. A
  client may connect before its server is listening; its requests then wait for it.
- ring: every device receives on a RingIn (PULL) and sends to its successor's RingIn (PUSH). A send never
  blocks longer than its timeout and never queues for a peer that is not there, so a dead successor shows up
  as a failed send rather than as a message lost in a buffer.

Endpoints are 'tcp://HOST:PORT' strings whatever the transport. Binding port 0 picks a free port; the bound
socket's `.address` is the endpoint it really listens on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from primaplug.transport.keys import ClusterKeys

# the frames of one ring message; a receiver may get zero-copy buffers, valid until its next recv
Frames = list[bytes | memoryview]


@runtime_checkable
class ControlServer(Protocol):
    address: str

    def recv(self, timeout_s: float) -> tuple[list[bytes], bytes] | None:
        """(envelope, request body), or None after the timeout. The envelope goes back with the reply."""
        ...

    def reply(self, envelope: list[bytes], body: bytes) -> None:
        """Answer the request that came with this envelope; a reply to a client that has gone is dropped."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ControlClient(Protocol):
    address: str

    def send(self, body: bytes) -> int:
        """Send a request without waiting; returns its id for take_reply()."""
        ...

    def take_reply(self, rid: int, timeout_s: float) -> bytes | None:
        """The reply to request `rid`, or None if none came within the timeout. Older replies are dropped."""
        ...

    def request(self, body: bytes, timeout_s: float) -> bytes | None:
        """send() then take_reply()."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RingIn(Protocol):
    address: str

    def recv(self, timeout_s: float) -> Frames | None:
        """The frames of the next ring message, or None after the timeout."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RingOut(Protocol):
    address: str

    def send(self, frames: Sequence[bytes | memoryview], timeout_s: float) -> bool:
        """Send one ring message; False if the successor could not take it within the timeout."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Makes every socket of a device. With keys, peers must hold the cluster key (where the transport can
    check it at all); without, traffic is in the clear (for loopback)."""

    keys: ClusterKeys | None

    def control_server(self, host: str, port: int) -> ControlServer:
        """Bind a control server on host:port (port 0: a free one). ConfigError if it cannot listen there."""
        ...

    def control_client(self, address: str) -> ControlClient:
        """Connect to the control server at an endpoint ('tcp://HOST:PORT')."""
        ...

    def ring_in(self, host: str, port: int) -> RingIn:
        """Bind this device's ring input on host:port (port 0: a free one). ConfigError if it cannot."""
        ...

    def ring_out(self, address: str) -> RingOut:
        """Connect to the successor's ring input at an endpoint ('tcp://HOST:PORT')."""
        ...

    def close(self) -> None:
        """Close every socket this transport made."""
        ...
