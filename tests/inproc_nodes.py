"""Node daemons in threads of the test process, over an in-process transport: the ring's logic (sessions, rewind,
replay, KV operations, timeouts, faults) tested in seconds, with real engines and real wire messages but no
subprocesses. The top rung (tests marked multiproc) runs the same daemons as processes over ZeroMQ."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from primaplug.node import Node, NodeSettings
from primaplug.transport import FaultyTransport, InprocNetwork, InprocTransport, Transport


class InprocNodes:
    """`with InprocNodes(models, 3) as nodes:` starts three Node daemons holding `models`, each in its own thread
    (`settings`: NodeSettings fields for all of them),
    on one network; `nodes.head_transport()` is a transport for the head on the same network. The nodes' sockets
    go through `nodes.faults`, so a test can drop, delay or corrupt what they send, or kill one."""

    def __init__(self, models: Sequence[Path], n: int, **settings: Any) -> None:
        self.network = InprocNetwork()
        self.faults = FaultyTransport(InprocTransport(self.network))
        self.nodes = [Node(NodeSettings(models=tuple(models), port=0, name=f"node{i + 1}", **settings), self.faults)
                      for i in range(n)]
        self._threads = [threading.Thread(target=n.serve, name=n.name, daemon=True) for n in self.nodes]

    @property
    def addresses(self) -> list[str]:
        """Each node's control address as HOST:PORT, in order."""
        return [n.control.address.removeprefix("tcp://") for n in self.nodes]

    def head_transport(self) -> Transport:
        return InprocTransport(self.network)

    def kill(self, i: int) -> None:
        """Node i dies: it hears and answers nothing from now on."""
        self.faults.kill(self.nodes[i].control.address, self.nodes[i].ring.address)

    def __enter__(self) -> InprocNodes:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for n in self.nodes:
            n.stop()
        for t in self._threads:
            t.join(timeout=10)
        self.faults.close()
