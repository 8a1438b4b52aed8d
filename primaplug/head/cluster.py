"""Connect to the nodes, check they hold the head's model, plan the windows, deploy them, and open the ring.

The ring order is the order the nodes are given in, with the head last; the head closes the ring. Windows come
from a plan (Halda or a baseline, `apply_plan`: the head first collects every node's profile and measures the
links over the ring) or from window sizes given per device in ring order (`plan`: the head's last, or left out to
give the head no layers; by default the nodes split the layers evenly and the head runs only the output layer).
With no nodes at all the head runs every window itself. What happens is published as events (head/events.py).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from primaplug.core.errors import ConfigError, NodeError, NodeHeldError, NodeUnavailableError, ProtocolError
from primaplug.core.profiles import DeviceProfile
from primaplug.core.settings import LOAD_TIMEOUT_S, RunSettings
from primaplug.core.windows import LayerRange, even_sizes, execution_order, ring_windows
from primaplug.device import DeviceWindows
from primaplug.engine import ModelLayout
from primaplug.head.embedding import EmbeddingRows
from primaplug.head.events import Deployed, Events, NodeMetrics, NodeProgress, Notice
from primaplug.head.identity import Head
from primaplug.head.nodes import NodeClient
from primaplug.head.ring import RingHead
from primaplug.memory.heap import map_large_blocks, return_freed_memory
from primaplug.scheduler import Plan
from primaplug.store import HolderService, file_manifest, piece_plan
from primaplug.store.manifest import needed_units
from primaplug.transport import RingIn, RingOut, Transport, endpoint, is_loopback, split_address
from primaplug.transport.addresses import on_every_interface, reachable, source_address
from primaplug.wire import (
    PROTOCOL_VERSION,
    Activation,
    Assignment,
    FileSource,
    Holder,
    ModelIdentity,
    Part,
    Welcome,
    WindowSpec,
    decode_ring,
    encode_ring,
)

if TYPE_CHECKING:
    from primaplug.engine import Window

log = logging.getLogger(__name__)

_RUN = RunSettings()
# (the sending device: a node's control address, or HEAD; the endpoint it should send to) -> the endpoint it
# connects to instead: lets an emulated cluster put a slow link in between
Route = Callable[[str, str], str]
HEAD = "head"


@dataclass
class Survey:
    """What asking the ring's nodes found (Cluster.survey)."""

    lost: list[NodeClient] = field(default_factory=list)  # silent
    stale: list[NodeClient] = field(default_factory=list)  # free, without this ring's windows (restarted, freed)
    taken: list[tuple[NodeClient, Holder]] = field(default_factory=list)  # held by another head: (node, that head)


@dataclass(frozen=True)
class ClusterSettings:
    nodes: tuple[str, ...]  # HOST:PORT of each node's control channel, in ring order
    layers: tuple[int, ...] | None = None  # layers per round for each node, then optionally for the head
    rounds: int = 1
    gpu_layers: tuple[int, ...] | None = None  # per node: how many of the first layers of each window go on its GPU
    head_gpu_layers: int = 0  # the head alone (no nodes): how many of the first layers of each of its windows
    # per node: layers of room beside the kept part when it streams layer by layer (Assignment.stream_room; 0 or
    # None: the node's own rule); a plan brings its own (scheduler/rooms.py)
    stream_rooms: tuple[int, ...] | None = None
    n_ctx: int = _RUN.n_ctx  # positions a sequence may hold
    n_parallel: int = _RUN.n_parallel  # sequences every window's cache holds (requests in flight)
    n_batch: int = _RUN.n_batch
    n_ubatch: int = _RUN.n_ubatch
    n_threads: int = _RUN.node_threads  # on each node; 0: all its cores
    listen: str = _RUN.listen  # where the head receives the ring's output (the last node must reach it)
    timeout_s: float = _RUN.timeout_s  # silence after which a node counts as gone
    load_timeout_s: float = LOAD_TIMEOUT_S
    route: Route | None = None
    n_rs_seq: int = 0  # recurrent-state snapshots each window keeps (a draft on a model that can roll back)

    def link(self, sender: str, endpoint: str) -> str:
        return self.route(sender, endpoint) if self.route else endpoint


def unique_names(nodes: Sequence[tuple[str, str]]) -> list[str]:
    """The names nodes go by, from their own names and addresses: two nodes of one name (a host name, say) are
    told apart by address."""
    names = [name for name, _ in nodes]
    return [name if names.count(name) == 1 else f"{name}@{address}" for name, address in nodes]


def describe_device(welcome: Welcome) -> str:
    d = welcome.device
    return f"{d.os} {d.machine}, {d.cpu_count} cores, {d.mem_total_bytes / 2**30:.1f} GiB"


def can_run(welcome: Welcome, model: ModelIdentity, head_holds_file: bool) -> bool:
    """Whether a node can run a model's windows: it holds the file, or it fetches (it has a model folder) and the
    head holds the file to fetch from."""
    return model.identity in {m.identity for m in welcome.models} or (
        welcome.device.disk_budget_bytes > 0 and head_holds_file)


def held_models(welcome: Welcome) -> str:
    return ", ".join(f"{m.file_name} ({m.identity})" for m in welcome.models) or "no model"


class Cluster:
    """The nodes of one ring and their assignment, for one head (`head`, default a new one: every request names it,
    and a node belongs to one head at a time). Close it to let the nodes go (they keep running, free for any head)."""

    def __init__(self, transport: Transport, settings: ClusterSettings, model: ModelIdentity,
                 events: Events | None = None, head: Head | None = None, layout: ModelLayout | None = None) -> None:
        hosts = [split_address(a)[0] for a in settings.nodes]
        if settings.nodes and transport.keys is None and not is_loopback(settings.listen):
            raise ConfigError(f"refusing to listen on {settings.listen} without encryption, as nodes do: make a "
                              "cluster key with `primaplug keygen cluster.key`, copy it to every device, and start "
                              "each node and the head with --keys cluster.key (or listen on 127.0.0.1)")
        if not all(is_loopback(h) for h in hosts):
            if transport.keys is None:
                raise ConfigError("nodes off this machine need the cluster key: pass --keys (see `primaplug keygen`)")
            if is_loopback(settings.listen):
                raise ConfigError("the last node cannot reach a head listening on loopback: pass --listen with "
                                  "this device's address on the nodes' network")
        self.transport, self.settings, self.model = transport, settings, model
        # the layout of the head's copy of the model (its path the file): nodes with a model folder fetch from it
        self.layout = layout
        self.holder: HolderService | None = None  # serves it to them, once one needs it (store/holder.py)
        self.events = events or Events()
        self.head = head or Head()
        # the ring's output comes back here; a head without nodes has no ring to listen to
        self.ring_in: RingIn | None = transport.ring_in(settings.listen, 0) if settings.nodes else None
        if self.ring_in is not None:
            self.head.address = self.ring_in.address
        self.nodes = [self.client(a) for a in settings.nodes]
        self.epoch = int(time.time() * 1000)
        self.head_ranges: list[LayerRange] = []
        self.node_ranges: list[list[LayerRange]] = []
        self.node_gpu: list[int] = []  # per node: layers of each of its windows on its GPU
        self.node_room: list[int] = []  # per node: Assignment.stream_room
        self.head_gpu = 0  # layers of each of the head's windows on its GPU
        self._outs: list[RingOut] = []

    def client(self, address: str) -> NodeClient:
        """A control connection to the node at `address`, for this cluster's head."""
        return NodeClient(self.transport, address, self.settings.timeout_s, head=self.head)

    @property
    def _head_in(self) -> RingIn:
        assert self.ring_in is not None, "a cluster without nodes has no ring"
        return self.ring_in

    def connect(self) -> None:
        """Say hello to every node and check that each holds the head's model."""
        # what crosses the ring in large blocks (probes, prompts' rows, a node's replies that libzmq's I/O thread
        # allocates) goes back to the OS when freed, as on a node: with glibc's rising threshold such blocks came
        # from that thread's heap, whose free top neither a trim nor a free returned (9.6 MiB kept after measuring
        # the links, in about 1 run of 4 of the suite). The cost is a map and an unmap a block: microseconds.
        map_large_blocks()
        welcomes = [n.hello() for n in self.nodes]
        for n, name in zip(self.nodes, unique_names([(n.name, n.address) for n in self.nodes]), strict=True):
            n.name = name
        wrong = []
        for n, w in zip(self.nodes, welcomes, strict=True):
            self.events.publish(NodeProgress(n.name, "connected", 0.0, describe_device(w)))
            if not self.can_serve(w):
                wrong.append(f"{n} holds {held_models(w)}")
        if wrong:
            raise NodeError(str(self.nodes[0]), "wrong_model",
                            f"the head runs {self.model.file_name} ({self.model.identity}), but " + "; ".join(wrong)
                            + ". Start every node with --model pointing at the same file, or with --model-dir to "
                            "fetch the layers it runs from the head.")

    # --- nodes that fetch the model (primaplug/store) ------------------------------------------------------------

    def can_serve(self, welcome: Welcome) -> bool:
        return can_run(welcome, self.model, self.layout is not None)

    def source(self, n: NodeClient) -> FileSource | None:
        """Where node n fetches the parts of the model it lacks (None when it holds the file): this head's holder,
        then the other nodes that keep copies."""
        w = n.welcome
        if w is None or self.model.identity in {m.identity for m in w.models}:
            return None
        if self.holder is None:
            self.holder = self._start_holder()
        here = self.holder.address
        if on_every_interface(here):
            here = reachable(here, source_address(split_address(n.address)[0]))
        peers = [endpoint(*split_address(m.address)) for m in self.nodes if m is not n and m.welcome is not None
                 and m.welcome.device.disk_budget_bytes > 0]
        return FileSource(holders=(self.settings.link(n.address, here), *peers),
                          manifest_sha256=self.holder.file.manifest.digest(), file_name=self.model.file_name)

    def missing_bytes(self) -> dict[str, int]:
        """What each node lacks of the model for its windows, by name, as it said when it connected: 0 for a node
        that holds the file, its windows' pieces (store/manifest.py) less the layers its copy held for the others."""
        out = {}
        for n, ranges in zip(self.nodes, self.node_ranges, strict=True):
            w = n.welcome
            if w is None or self.model.identity in {m.identity for m in w.models} or self.layout is None:
                out[n.name] = 0
                continue
            layout = self.layout
            held = {u for c in w.copies if c.model == self.model.identity for u in c.units}
            units = needed_units(layout, [il for r in ranges for il in range(r.start, r.end)]) - held
            out[n.name] = sum(p.length for p in piece_plan(layout) if p.unit in units)
        return out

    def _start_holder(self) -> HolderService:
        layout = self.layout
        assert layout is not None
        t0 = time.perf_counter()
        self.events.publish(Notice(f"hashing {self.model.file_name} ({layout.file_size / 2**30:.2f} GiB) for the "
                                   "nodes that fetch it (once: the hashes are kept until the file changes)"))

        def progress(frac: float, what: str) -> None:
            log.info("%s", what)

        manifest = file_manifest(layout.path, layout, progress=progress)
        holder = HolderService(self.transport, self.settings.listen, layout.path, manifest)
        self.events.publish(Notice(f"serving {self.model.file_name} to the nodes that fetch it at {holder.address} "
                                   f"({len(manifest.offsets)} pieces, hashed in {time.perf_counter() - t0:.1f} s)"))
        return holder

    def kernels(self, head_cpu: str) -> dict[str, str]:
        """The kernels each device of the ring computes with, by name, the head's first (its CPU's: head_cpu): its
        CPU's (engine.cpu_kernels, a node's from its Welcome; empty from an older node), and "+ GPU" where some of
        its layers run on a GPU. Devices of different kernels round differently (cli/verify.py)."""
        def gpu(n: int) -> str:
            return " + GPU" if n > 0 else ""

        out = {"head": head_cpu + gpu(self.head_gpu)}
        for i, n in enumerate(self.nodes):
            if n.welcome is not None:
                out[n.name] = n.welcome.device.kernels + (gpu(self.node_gpu[i]) if i < len(self.node_gpu) else "")
        return out

    def plan(self) -> None:
        """Turn the settings' window sizes (or an even split over the nodes) into windows per device."""
        s, n_layer = self.settings, self.model.n_layer
        if s.rounds < 1 or n_layer % s.rounds:
            raise ConfigError(f"the rounds must divide the model's {n_layer} layers, got {s.rounds}")
        if not self.nodes:  # the head alone: the sizes are windows it chains in ring order, one "round" each
            sizes = list(s.layers) if s.layers else [n_layer // s.rounds]
            self.head_ranges = [w for w in execution_order(ring_windows(sizes, s.rounds, n_layer)) if w.n_layers]
            self.head_gpu = s.head_gpu_layers
            self._check_windows()
            return
        lay = self.layout
        sizes = list(s.layers) if s.layers else even_sizes(
            n_layer, len(self.nodes), s.rounds, lay.kv_tail if lay else 0, lay.barred_starts if lay else ())
        if len(sizes) == len(self.nodes):
            sizes.append(0)  # the head runs only the output layer
        if len(sizes) != len(self.nodes) + 1:
            raise ConfigError(f"give one window size per node ({len(self.nodes)}), plus optionally one for the "
                              f"head; got {len(sizes)}")
        per_device = ring_windows(sizes, s.rounds, n_layer)
        self.node_ranges, self.head_ranges = per_device[:-1], per_device[-1]
        self._check_windows()
        gpu = list(s.gpu_layers or ())
        self.node_gpu = [gpu[i] if i < len(gpu) else 0 for i in range(len(self.nodes))]
        rooms = list(s.stream_rooms or ())
        self.node_room = [rooms[i] if i < len(rooms) else 0 for i in range(len(self.nodes))]

    @property
    def row_end(self) -> int:
        """Where the rows' per-layer inputs stop (ContextSettings.row_end): at the head's last window, whose layers'
        inputs the head keeps from its input window instead of sending them round the ring; 0: every layer's."""
        last = self.head_ranges[-1] if self.head_ranges else None
        if (self.layout is None or not self.layout.input_window or not self.nodes or last is None
                or not last.n_layers or last.end != self.model.n_layer):
            return 0
        return last.start

    def _check_windows(self) -> None:
        """Raise WindowRangeError, before any node loads, when a window would hold a layer that reads what one
        outside it computed: its keys and values (Gemma 4) or its indexer's choice (GLM 5.2); see
        ModelLayout.check_windows."""
        if self.layout is not None:
            self.layout.check_windows([*self.head_ranges, *(r for rs in self.node_ranges for r in rs)])

    # --- planning from measurements --------------------------------------------------------------------------

    def profiles(self, force: bool = False) -> list[DeviceProfile]:
        """Every node's DeviceProfile for the model, one node after the other (nodes on one machine would
        otherwise slow each other's measurements). Nodes drop windows a previous head left them first."""
        out = []
        for n in self.nodes:
            n.unload()
            p = n.profile(self.model.identity, force=force, source=self.source(n),
                          progress=lambda what, n=n: self.events.publish(NodeProgress(n.name, "profiling", 0.0, what)))
            self.events.publish(NodeProgress(n.name, "profiling", 1.0, "profiled"))
            out.append(msgspec.structs.replace(p, name=n.name))  # unique: connect() told namesakes apart
        return out

    def measure_links(self, rows: int = 256, repeats: int = 7) -> tuple[float, float]:
        """(latency in s, bandwidth in bytes/s) of one hop, measured over the ring itself: every node relays
        probes of 1 and of `rows` hidden rows round the ring, len(nodes) + 1 hops a trip, and the fastest trip of
        each size counts; each hop gets its share (which includes a node's decode, check and send)."""
        times = self._time_probes(rows, repeats)
        # what the probes left in the heap below the mapping threshold: 5.7 MiB of the head on the peers' W1 model,
        # 3% of its device there, before the head mapped large blocks (docs/peers.md)
        return_freed_memory()
        hops = len(self.nodes) + 1
        extra = times[rows] - times[1]
        if extra <= 0:  # the larger probe no slower than one row: a link faster than the clock tells apart
            log.warning("the ring's links moved %d rows no slower than 1; taking them as 10 GB/s", rows)
            extra = hops * (rows - 1) * 4 * self.model.n_embd / 10e9
        bps = hops * (rows - 1) * 4 * self.model.n_embd / extra
        return times[1] / hops, bps

    def _time_probes(self, rows: int, repeats: int) -> dict[int, float]:
        """The fastest trip round the ring of a probe of 1 and of `rows` rows (the nodes relay them)."""
        s, epoch = self.settings, self.epoch - 1
        for i, n in enumerate(self.nodes):
            n.load(Assignment(epoch=epoch, model=self.model, windows=(WindowSpec(0, 0),), successor=self._successor(i),
                              n_ctx=max(rows, 1), n_batch=max(rows, 1), n_ubatch=max(rows, 1)), self.source(n))
        self._wait_loaded(epoch)
        out = self.transport.ring_out(s.link(HEAD, self._ring_endpoint(0)))
        try:
            times = {}
            for n_rows in (1, rows):
                # zeros in a mapping of their own: pyzmq holds a zero-copy send's buffer until its own thread lets
                # go, which may be after measure_links has handed the heap back (then 10 MiB stayed, once in CI);
                # a mapping goes back to the OS whenever it is let go
                data = np.frombuffer(mmap.mmap(-1, n_rows * self.model.n_embd * 4), np.float32)
                data = data.reshape(n_rows, self.model.n_embd)
                trips = []
                for step in range(repeats):
                    msg = Activation(proto=PROTOCOL_VERSION, epoch=epoch, step=step, round=0,
                                     parts=(Part(0, 0, n_rows, True),), width=self.model.n_embd, dtype="float32")
                    t0 = time.perf_counter()
                    sent = out.send(encode_ring(msg, data), s.timeout_s)
                    got = self._head_in.recv(s.timeout_s) if sent else None
                    if got is None:
                        raise self._lost("a link probe", f"{n_rows} row(s), trip {step + 1}")
                    back, _ = decode_ring(got)
                    if not isinstance(back, Activation) or back.step != step:
                        raise ProtocolError(f"a link probe came back as {back!r}")
                    trips.append(time.perf_counter() - t0)
                # the first trip connects; the fastest of the others is the link's, the rest is the machine's noise
                times[n_rows] = min(trips[1:])
        finally:
            out.close()
            for n in self.nodes:
                try:
                    n.unload()
                except (NodeError, NodeUnavailableError) as e:  # already said, or about to be
                    log.warning("%s", e)
        return times

    def _lost(self, what: str, detail: str) -> NodeUnavailableError:
        """The error for a message that did not come back round the ring: names the first node that no longer
        answers on its control channel, or says that all of them do."""
        for n in self.nodes:
            try:
                n.status()
            except NodeUnavailableError:
                return NodeUnavailableError(n.name, f"node {n} stopped answering: {what} ({detail}) did not come "
                                            f"back round the ring within {self.settings.timeout_s:.1f} s")
        return NodeUnavailableError(self.nodes[-1].name, f"{what} ({detail}) did not come back round the ring within "
                                    f"{self.settings.timeout_s:.1f} s, though every node answers: check that the "
                                    f"last node, {self.nodes[-1]}, can reach the head at {self._head_in.address}")

    def apply_given_plan(self, plan: Plan) -> None:
        """Take a plan made earlier for these nodes (named as they name themselves): each of its devices but the
        head must be one of them."""
        names = [n.name for n in self.nodes]
        missing = [d.name for d in plan.ring[:-1] if d.name not in names]
        if missing:
            raise ConfigError(f"the plan runs windows on {', '.join(missing)}, which are not among the nodes connected "
                              f"({', '.join(names) or 'none'}): plan again for the nodes there are")
        if plan.n_layer != self.model.n_layer:
            raise ConfigError(f"the plan is for {plan.n_layer} layers, the model has {self.model.n_layer}")
        self.apply_plan(plan, names)

    def apply_plan(self, plan: Plan, names: Sequence[str]) -> None:
        """Take the windows of a plan whose devices are the head and then the nodes (`names[i]` is node i's
        name in the plan); nodes the plan dropped leave the ring."""
        keep = [(n, plan.device(name)) for n, name in zip(self.nodes, names, strict=True)
                if any(d.name == name for d in plan.devices)]
        for n in self.nodes:
            if all(n is not k for k, _ in keep):
                self.events.publish(NodeProgress(n.name, "left", 0.0, "the plan runs faster without it"))
                with contextlib.suppress(NodeError, NodeUnavailableError, ProtocolError):
                    n.release()  # profiled by this head: let it go for others
                n.close()
        self.nodes = [n for n, _ in keep]
        self.node_ranges = [list(d.windows) for _, d in keep]
        self.node_gpu = [d.n for _, d in keep]
        self.node_room = [d.room for _, d in keep]
        self.head_ranges = list(plan.head.windows)
        self.head_gpu = plan.head.n  # a head with a GPU gets GPU layers from Halda and the baselines too
        self._check_windows()

    def head_gpu_layers(self) -> list[int]:
        """The layers the head runs on its GPU: the first head_gpu of each of its windows."""
        return [il for r in self.head_ranges for il in range(r.start, r.start + min(self.head_gpu, r.n_layers))]

    # --- deploying -------------------------------------------------------------------------------------------

    def _ring_endpoint(self, i: int) -> str:
        welcome = self.nodes[i].welcome
        assert welcome is not None
        # a node listening on every interface (0.0.0.0) is reached where the head reached it
        return reachable(welcome.ring_endpoint, split_address(self.nodes[i].address)[0])

    def _successor(self, i: int) -> str:
        """Where node i sends its output: the next node, or the head after the last (a head listening on every
        interface, --listen 0.0.0.0, at its address on the way to that node)."""
        if i + 1 < len(self.nodes):
            nxt = self._ring_endpoint(i + 1)
        else:
            nxt = self._head_in.address
            if on_every_interface(nxt):
                nxt = reachable(nxt, source_address(split_address(self.nodes[i].address)[0]))
        return self.settings.link(self.nodes[i].address, nxt)

    def deploy(self) -> None:
        """Send every node its assignment and wait until all have loaded."""
        s = self.settings
        for i, n in enumerate(self.nodes):
            windows = tuple(WindowSpec(r.start, r.end, min(self.node_gpu[i], r.n_layers)) for r in self.node_ranges[i])
            n.load(Assignment(epoch=self.epoch, model=self.model, windows=windows, successor=self._successor(i),
                              n_ctx=s.n_ctx * s.n_parallel, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                              n_threads=s.n_threads, n_seq_max=s.n_parallel,
                              stream_room=self.node_room[i], n_rs_seq=s.n_rs_seq, row_end=self.row_end),
                   self.source(n))
        t0 = time.perf_counter()
        self._wait_loaded(self.epoch, report=True)
        nodes = tuple((n.name, tuple(r)) for n, r in zip(self.nodes, self.node_ranges, strict=True))
        self.events.publish(Deployed(nodes, tuple(self.head_ranges), time.perf_counter() - t0))

    def _wait_loaded(self, epoch: int, report: bool = False) -> None:
        s = self.settings
        deadline = time.monotonic() + s.load_timeout_s
        pending = list(self.nodes)
        while pending:
            for n in list(pending):
                st = n.status()
                by = n.taken_by(st)
                if by is not None:  # another head took it over meanwhile: its load replaced this one, which never ends
                    raise NodeHeldError(str(n), f"was taken over by {by.describe()} while it loaded this head's "
                                        "windows", by)
                if report:
                    self.events.publish(NodeProgress(n.name, st.state if st.epoch == epoch else "loading",
                                                     st.progress, st.message))
                if st.state == "ready" and st.epoch == epoch:
                    pending.remove(n)
                elif st.state == "failed":
                    self.events.publish(NodeProgress(n.name, "failed", st.progress, st.message))
                    raise NodeError(str(n), "load_failed", f"could not load its windows: {st.message}")
            if pending and time.monotonic() > deadline:
                raise NodeUnavailableError(pending[0].name, f"node {pending[0]} did not finish loading within "
                                           f"{s.load_timeout_s:.0f} s")
            if pending:
                time.sleep(0.05)

    def ring(self, local: DeviceWindows | None, entry: Window | None = None) -> RingHead:
        """The ring, closed by the head, with the head's own windows (`local`: one per round, over head_ranges) and
        its input window (`entry`, on a model with per-layer inputs).
        Without nodes (none given, or a plan that found the head fastest alone) the head runs every window. A ring
        made before (of an earlier assignment) stops sending."""
        for old in self._outs:
            old.close()
        self._outs.clear()
        out = None
        if self.nodes:
            out = self.transport.ring_out(self.settings.link(HEAD, self._ring_endpoint(0)))
            self._outs.append(out)
        return RingHead(self.nodes, self.ring_in, out, self.epoch, local, len(self.head_ranges), self.model.n_layer,
                        self.model.n_embd, self.settings.timeout_s, self._embedding(), entry,
                        self.row_end if entry is not None else 0)

    def _embedding(self) -> EmbeddingRows | None:
        """The token embedding's rows for the node that runs layer 0, when it fetched its layers (it has none)."""
        first = next((n for n, ranges in zip(self.nodes, self.node_ranges, strict=True)
                      if ranges and ranges[0].start == 0 and ranges[0].n_layers), None)
        w = first.welcome if first is not None else None
        if (w is None or self.holder is None or self.layout is None
                or self.model.identity in {m.identity for m in w.models}
                or self.layout.tensor("token_embd.weight") is None or self.layout.input_window):
            return None
        return EmbeddingRows(self.holder.file.fd, self.layout)

    # --- re-forming: nodes lost or joined (head/recovery.py) ------------------------------------------------------

    @property
    def rounds(self) -> int:
        """k: the windows each device runs per token."""
        return len(self.node_ranges[0]) if self.node_ranges else max(1, len(self.head_ranges))

    @property
    def head_size(self) -> int:
        """The head's layers per round (every round's window has the same size)."""
        return self.head_ranges[0].n_layers if self.head_ranges and self.nodes else 0

    def node_sizes(self) -> list[int]:
        """Each node's layers per round, in ring order."""
        return [r[0].n_layers for r in self.node_ranges]

    def survey(self, timeout_s: float, skip: Sequence[NodeClient] = ()) -> Survey:
        """Ask every node (but those to skip) for its status: those that do not answer within timeout_s are lost,
        those that another head holds now are taken, and those that answer without this assignment loaded (restarted,
        or freed their windows) are stale."""
        found = Survey()
        for n in self.nodes:
            if any(n is m for m in skip):
                continue
            try:
                st = n.status(timeout_s=timeout_s)
            except (NodeError, NodeUnavailableError, ProtocolError):
                found.lost.append(n)
                continue
            by = n.taken_by(st)
            if by is not None:
                found.taken.append((n, by))
            elif st.state != "ready" or st.epoch != self.epoch:
                found.stale.append(n)
        return found

    def reform(self, nodes: list[NodeClient], sizes: Sequence[int], gpu: Sequence[int],
               lost: Sequence[NodeClient] = (), *, rooms: Sequence[int] = ()) -> None:
        """Deploy the ring again under a new assignment over `nodes` (in ring order) with `sizes` layers per round
        each (and `rooms`, Assignment.stream_room, chosen for these windows; none: each node's own rule); the head
        keeps its windows (so it keeps its model, which every request's context reads), and nodes that leave are let
        go (they free their windows), but for the `lost` ones (asking them would only wait out the timeout, and they
        free their windows themselves) and those another head took."""
        ranges = ring_windows([*sizes, self.head_size], self.rounds, self.model.n_layer)
        if [r for r in ranges[-1] if r.n_layers] != [r for r in self.head_ranges if r.n_layers]:
            raise ConfigError(f"a re-formed ring must leave the head its windows {self.head_ranges}, got {ranges[-1]}")
        if rooms and len(rooms) != len(nodes):
            raise ConfigError(f"a re-formed ring needs a room for each of its {len(nodes)} node(s), got {list(rooms)}")
        for n in self.nodes:
            if all(n is not m for m in nodes) and all(n is not m for m in lost):
                with contextlib.suppress(NodeError, NodeUnavailableError, ProtocolError):
                    n.release()
        self.nodes, self.node_ranges, self.node_gpu = list(nodes), ranges[:-1], list(gpu)
        self.node_room = list(rooms) or [0] * len(self.nodes)
        self.epoch = max(int(time.time() * 1000), self.epoch + 1)
        self.deploy()

    def metrics(self) -> None:
        """Ask every node for its detailed status and publish it (NodeMetrics)."""
        for n in self.nodes:
            self.events.publish(NodeMetrics(n.name, n.status(detail=True)))

    def shutdown_nodes(self) -> None:
        """Ask every node to exit (those that do not answer are skipped)."""
        for n in self.nodes:
            try:
                n.shutdown()
            except (NodeError, NodeUnavailableError) as e:
                log.warning("%s", e)

    def release(self) -> None:
        """Let every node go that this head used: each frees its windows, and any head may deploy there at once."""
        for n in self.nodes:
            try:
                n.release()
            except (NodeError, NodeUnavailableError, ProtocolError) as e:  # gone, or taken: nothing of ours is there
                log.info("%s", e)

    def close(self) -> None:
        """Let the nodes go (release) and disconnect."""
        self.release()
        for n in self.nodes:
            n.close()
        for out in self._outs:
            out.close()
        if self.ring_in is not None:
            self.ring_in.close()
        if self.holder is not None:
            self.holder.close()
