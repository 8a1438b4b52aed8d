"""The head's side of the cluster: talk to the nodes, deploy an assignment, drive tokens round the ring."""

from primaplug.coordinator.cluster import Cluster, ClusterSettings
from primaplug.coordinator.nodes import NodeClient
from primaplug.coordinator.ring import LocalWindow, RingHead

__all__ = ["Cluster", "ClusterSettings", "LocalWindow", "NodeClient", "RingHead"]
