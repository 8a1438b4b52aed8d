"""The link proxy's control, from another process than the one that started it (testbed/linkproxy.py).

A module of its own, on plain sockets, because primaplug's head imports it on its emulated device: the proxy's
asyncio (with ssl) would be 2 MiB of the head's memory that no user's head holds.
"""

from __future__ import annotations

import socket


class RemoteLinks:
    """Links from another process than the one that started the proxy: `route` as LinkProxy's, over its control
    endpoint (LinkProxy.control)."""

    def __init__(self, control: str) -> None:
        host, port = control.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.file = self.sock.makefile("rw")

    def route(self, endpoint: str, latency_ms: float, mbit: float, sender: str = "") -> str:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.file.write(f"add {host.strip('[]')} {port} {latency_ms} {mbit} 0 {sender}\n")
        self.file.flush()
        line = self.file.readline().strip()
        if not line.startswith("tcp://"):
            raise RuntimeError(f"the link proxy did not start a link to {endpoint}: {line or 'it closed'}")
        return line

    def close(self) -> None:
        self.sock.close()
