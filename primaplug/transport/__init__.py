"""The sockets of a device, behind one seam: the control channel (requests to a node, one reply each) and the
ring (one-way messages to the next device), as bytes frames.

    Transport (base.py)        the protocol everything above this package talks to, with ControlServer,
                               ControlClient, RingIn and RingOut
    ZmqTransport (sockets.py)  ZeroMQ over TCP, with CurveZMQ keys and authentication: what devices run
    InprocTransport (inproc.py) in-process queues with ZeroMQ's semantics, on an InprocNetwork: for tests and
                               for a device that plays two roles in one process
    FaultyTransport (faults.py) wraps either, and drops, delays or corrupts messages or kills a peer

Only sockets.py and keys.py import zmq, and only when used: ZmqTransport is loaded on first access (PEP 562) and
keys.py imports zmq inside the functions that need it, so a process (or test) that uses InprocTransport alone
never loads ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primaplug.transport.addresses import endpoint, is_loopback, split_address
from primaplug.transport.base import ControlClient, ControlServer, Frames, RingIn, RingOut, Transport
from primaplug.transport.faults import FaultyTransport
from primaplug.transport.inproc import InprocNetwork, InprocTransport
from primaplug.transport.keys import ClusterKeys, generate_keys, load_keys

if TYPE_CHECKING:
    from primaplug.transport.sockets import ZmqTransport

__all__ = ["ClusterKeys", "ControlClient", "ControlServer", "FaultyTransport", "Frames", "InprocNetwork",
           "InprocTransport", "RingIn", "RingOut", "Transport", "ZmqTransport", "endpoint", "generate_keys",
           "is_loopback", "load_keys", "split_address"]


def __getattr__(name: str) -> Any:
    if name == "ZmqTransport":
        from primaplug.transport.sockets import ZmqTransport

        return ZmqTransport
    raise AttributeError(f"module 'primaplug.transport' has no attribute {name!r}")
