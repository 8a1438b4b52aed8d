"""ZeroMQ, and nothing else: the control and ring sockets, CurveZMQ keys and authentication.

The only package that imports zmq. Everything above it sends and receives bytes frames.
"""

from primaplug.transport.keys import ClusterKeys, generate_keys, load_keys
from primaplug.transport.sockets import (
    ControlClient,
    ControlServer,
    RingIn,
    RingOut,
    Transport,
    endpoint,
    is_loopback,
    split_address,
)

__all__ = ["ClusterKeys", "ControlClient", "ControlServer", "RingIn", "RingOut", "Transport", "endpoint",
           "generate_keys", "is_loopback", "load_keys", "split_address"]
