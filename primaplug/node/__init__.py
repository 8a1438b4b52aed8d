"""The `primaplug node` daemon: holds windows of a model and serves its place in the ring."""

from primaplug.node.daemon import Node, NodeSettings

__all__ = ["Node", "NodeSettings"]
