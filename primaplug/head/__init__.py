"""The head: the device the user types on. It connects to the nodes, plans and deploys their windows, and owns
each request through a session (head/session.py); `primaplug.Llama` (head/llama.py) is its face to the user.

`Llama` is imported on first use (it loads the engine); the rest loads no native code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primaplug.head.cluster import Cluster, ClusterSettings
from primaplug.head.events import ClusterView, Event, Events
from primaplug.head.nodes import NodeClient
from primaplug.head.ring import RingHead
from primaplug.head.session import Session

if TYPE_CHECKING:
    from primaplug.head.llama import Llama

__all__ = ["Cluster", "ClusterSettings", "ClusterView", "Event", "Events", "Llama", "NodeClient", "RingHead",
           "Session"]


def __getattr__(name: str) -> Any:
    if name == "Llama":
        from primaplug.head.llama import Llama

        return Llama
    raise AttributeError(f"module 'primaplug.head' has no attribute {name!r}")
