"""This head as nodes know it: the identity every request it sends names (wire.HeadTag).

A node belongs to one head at a time (node/owner.py). The id is random, made once per head (a primaplug.Llama, the
dashboard's coordinator), and stays the same across reconnects and re-formings. It is not the cluster key: every
device of a cluster holds the same key, so the key tells a cluster's devices from strangers, not one head from
another. Over CurveZMQ the id travels encrypted, so only a holder of the cluster key could claim it.
"""

from __future__ import annotations

import os
import platform
import secrets
import sys
import time
from dataclasses import dataclass, field

from primaplug.wire import HeadTag


def _program() -> str:
    """What this process is, for people reading a refusal: "primaplug serve", or the program's name."""
    argv = sys.argv
    if not argv or not argv[0]:
        return "python"
    prog = os.path.basename(argv[0])
    if prog == "__main__.py":  # python -m PACKAGE
        prog = os.path.basename(os.path.dirname(argv[0]))
    return f"primaplug {argv[1]}" if prog == "primaplug" and len(argv) > 1 else prog


@dataclass
class Head:
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    name: str = field(default_factory=lambda: f"{_program()} (pid {os.getpid()}) on {platform.node()}")
    address: str = ""  # where it receives the ring's output, once it listens
    started: float = field(default_factory=time.time)
    served: int = 0  # requests completed (primaplug.Llama counts them)
    # take the nodes even from a head that holds them (--take-over): for the first deployment only, so that a head
    # that took nodes never fights to take them again from the next head that takes them on purpose
    take_over: bool = False

    def tag(self) -> HeadTag:
        return HeadTag(id=self.id, name=self.name, address=self.address, started=self.started, served=self.served)
