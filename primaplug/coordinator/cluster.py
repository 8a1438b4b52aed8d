"""Connect to the nodes, check they hold the head's model, deploy a manual split, and open the ring.

The ring order is the order the nodes are given in, with the head last; the head closes the ring. Window sizes
are given per device in that order (the head's last, or left out to give the head no layers), for each round;
by default the nodes split the layers evenly and the head runs only the output layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from primaplug.core.errors import ConfigError, NodeError, NodeUnavailableError
from primaplug.core.windows import LayerRange, even_split, ring_windows
from primaplug.coordinator.nodes import NodeClient
from primaplug.coordinator.ring import LocalWindow, RingHead
from primaplug.transport import RingIn, RingOut, Transport, is_loopback, split_address
from primaplug.wire import Assignment, ModelIdentity, WindowSpec

log = logging.getLogger(__name__)

Progress = Callable[[str, float, str], None]  # (node, fraction done, what it is doing)


@dataclass(frozen=True)
class ClusterSettings:
    nodes: tuple[str, ...]  # HOST:PORT of each node's control channel, in ring order
    layers: tuple[int, ...] | None = None  # layers per round for each node, then optionally for the head
    rounds: int = 1
    gpu_layers: tuple[int, ...] | None = None  # per node: how many of the first layers of each window go on its GPU
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 0  # on each node; 0: all its cores
    listen: str = "127.0.0.1"  # where the head receives the ring's output (the last node must reach it)
    timeout_s: float = 5.0  # silence after which a node counts as gone
    load_timeout_s: float = 600.0


class Cluster:
    """The nodes of one ring and their assignment. Close it to disconnect (nodes keep running)."""

    def __init__(self, transport: Transport, settings: ClusterSettings, model: ModelIdentity) -> None:
        if not settings.nodes:
            raise ConfigError("a ring needs at least one node")
        hosts = [split_address(a)[0] for a in settings.nodes]
        if not all(is_loopback(h) for h in hosts):
            if transport.keys is None:
                raise ConfigError("nodes off this machine need the cluster key: pass --keys (see `primaplug keygen`)")
            if is_loopback(settings.listen):
                raise ConfigError("the last node cannot reach a head listening on loopback: pass --listen with "
                                  "this device's address on the nodes' network")
        self.transport, self.settings, self.model = transport, settings, model
        self.nodes = [NodeClient(transport, a, settings.timeout_s) for a in settings.nodes]
        self.ring_in: RingIn = transport.ring_in(settings.listen, 0)
        self.epoch = int(time.time() * 1000)
        self.head_ranges: list[LayerRange] = []
        self.node_ranges: list[list[LayerRange]] = []
        self._outs: list[RingOut] = []

    def connect(self) -> None:
        """Say hello to every node and check that each holds the head's model."""
        wrong = []
        for n in self.nodes:
            w = n.hello()
            if self.model.identity not in {m.identity for m in w.models}:
                held = ", ".join(f"{m.file_name} ({m.identity})" for m in w.models)
                wrong.append(f"{n} holds {held}")
        if wrong:
            raise NodeError(str(self.nodes[0]), "wrong_model",
                            f"the head runs {self.model.file_name} ({self.model.identity}), but " + "; ".join(wrong)
                            + ". Start every node with --model pointing at the same file.")

    def plan(self) -> None:
        """Turn the settings' window sizes (or an even split over the nodes) into windows per device."""
        s, n_layer = self.settings, self.model.n_layer
        if n_layer % s.rounds:
            raise ConfigError(f"{s.rounds} rounds do not divide the model's {n_layer} layers")
        sizes = list(s.layers) if s.layers else even_split(n_layer // s.rounds, len(self.nodes))
        if len(sizes) == len(self.nodes):
            sizes.append(0)  # the head runs only the output layer
        if len(sizes) != len(self.nodes) + 1:
            raise ConfigError(f"give one window size per node ({len(self.nodes)}), plus optionally one for the "
                              f"head; got {len(sizes)}")
        per_device = ring_windows(sizes, s.rounds, n_layer)
        self.node_ranges, self.head_ranges = per_device[:-1], per_device[-1]

    def deploy(self, progress: Progress | None = None) -> None:
        """Send every node its assignment and wait until all have loaded."""
        s = self.settings
        gpu = list(s.gpu_layers or [0] * len(self.nodes))
        for i, n in enumerate(self.nodes):
            assert n.welcome is not None
            successor = self.nodes[i + 1].welcome.ring_endpoint if i + 1 < len(self.nodes) else self.ring_in.address  # type: ignore[union-attr]
            windows = tuple(WindowSpec(r.start, r.end, min(gpu[i] if i < len(gpu) else 0, r.n_layers))
                            for r in self.node_ranges[i])
            n.load(Assignment(epoch=self.epoch, model=self.model, windows=windows, successor=successor,
                              n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch, n_threads=s.n_threads))
        deadline = time.monotonic() + s.load_timeout_s
        pending = list(self.nodes)
        while pending:
            for n in list(pending):
                st = n.status()
                if progress:
                    progress(str(n), st.progress, st.message)
                if st.state == "ready" and st.epoch == self.epoch:
                    pending.remove(n)
                elif st.state == "failed":
                    raise NodeError(str(n), "load_failed", f"could not load its windows: {st.message}")
            if pending and time.monotonic() > deadline:
                raise NodeUnavailableError(pending[0].name, f"node {pending[0]} did not finish loading within "
                                           f"{s.load_timeout_s:.0f} s")
            if pending:
                time.sleep(0.05)

    def ring(self, head_windows: Sequence[LocalWindow | None]) -> RingHead:
        """The ring, closed by the head, with the head's own windows (one per round, None where it has none)."""
        first = self.nodes[0].welcome
        assert first is not None
        out = self.transport.ring_out(first.ring_endpoint)
        self._outs.append(out)
        return RingHead(self.nodes, self.ring_in, out, self.epoch, head_windows, self.model.n_layer,
                        self.model.n_embd, self.settings.timeout_s)

    def shutdown_nodes(self) -> None:
        """Ask every node to exit (those that do not answer are skipped)."""
        for n in self.nodes:
            try:
                n.shutdown()
            except (NodeError, NodeUnavailableError) as e:
                log.warning("%s", e)

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        for out in self._outs:
            out.close()
        self.ring_in.close()
