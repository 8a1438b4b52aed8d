"""The coordinator: the head as the dashboard drives it, one step at a time.

`primaplug.Llama` goes from addresses to a running ring in one call. The dashboard shows each step and lets the user
choose between them: it holds the nodes by address (add, remove), connects to them, profiles them and the links,
plans with any scheduler or a split typed in (and scores the other numbers of rounds), deploys the chosen plan as a
`primaplug.Llama`, chats through it, and watches the nodes while they run. Every method blocks; the dashboard calls
them from worker threads, one at a time (a lock keeps it so), except `watch`, which only the watcher thread calls and
which has its own sockets. What happens is published on the head's event bus.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from primaplug.core.errors import ConfigError, NodeError, NodeHeldError, NodeUnavailableError, PrimaplugError
from primaplug.core.profiles import DeviceProfile
from primaplug.core.settings import DRAFT_MAX, DRAFT_MIN, RunSettings
from primaplug.core.windows import even_sizes
from primaplug.decoding import check_draft_length
from primaplug.engine import ModelLayout, read_layout
from primaplug.head.cluster import Cluster, ClusterSettings, can_run, describe_device, held_models, unique_names
from primaplug.head.events import Event, Events, NodeMetrics, NodeProgress, Notice, Planned
from primaplug.head.identity import Head
from primaplug.head.nodes import NodeClient
from primaplug.head.planning import Measured, PlanSettings, draft_bytes, measure, plan_with_speculation
from primaplug.scheduler import SCHEDULERS, Plan, alternatives, check_gpu_layers, placement, solve
from primaplug.store import resolve_model
from primaplug.transport import Transport, ZmqTransport, load_keys
from primaplug.wire import ModelIdentity, Status

if TYPE_CHECKING:
    from primaplug.head.llama import Llama

log = logging.getLogger(__name__)
_RUN = RunSettings()
PLANNERS = (*SCHEDULERS, "even", "manual")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: a scheduler (halda, memory, compute), an even split, or a split typed in."""

    scheduler: str = "halda"
    rounds: int | None = None  # None: the scheduler's choice (1 for even and manual)
    layers: tuple[int, ...] = ()  # manual: layers per round of each node in ring order, then optionally the head's
    gpu_layers: int = 0  # even and manual: layers of each node window on its GPU


@dataclass(frozen=True)
class PlanChoice:
    """A plan, and the other numbers of rounds the scheduler weighed: (k, its plan or why there is none)."""

    request: PlanRequest
    plan: Plan
    alternatives: tuple[tuple[int, Plan | str], ...] = ()


@dataclass
class NodeEntry:
    """One node the coordinator knows, by the address it was given."""

    address: str
    own: str = ""  # the node's own name, once it said hello
    name: str = ""  # the name it goes by here (its own, or name@address when two share one)
    facts: str = ""  # OS, machine, cores, memory, from its hello
    error: str = ""  # why it cannot be used, when it cannot

    @property
    def label(self) -> str:
        return self.name or self.own or self.address


@dataclass
class _Watch:
    """The watcher's own control connections, and what it last saw of each node."""

    clients: dict[str, NodeClient] = field(default_factory=dict)
    busy: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (time, busy_s) at the last poll
    down: set[str] = field(default_factory=set)
    held: dict[str, str | None] = field(default_factory=dict)  # name -> the id of another head that holds it


class Coordinator:
    """The nodes of one cluster (by address), what was measured of them, the plan and the ring deployed."""

    def __init__(self, model_path: str | os.PathLike[str], addresses: Sequence[str] = (), *,
                 keys: str | os.PathLike[str] | None = None, listen: str = _RUN.listen,
                 timeout_s: float = _RUN.timeout_s, n_ctx: int = _RUN.n_ctx, n_batch: int = _RUN.n_batch,
                 n_ubatch: int = _RUN.n_ubatch, node_threads: int = _RUN.node_threads,
                 chat_format: str | None = None, plan_settings: PlanSettings | None = None,
                 draft_model: str | os.PathLike[str] | None = None, draft_max: int = DRAFT_MAX,
                 draft_min: int = DRAFT_MIN, events: Events | None = None,
                 transport: Transport | None = None) -> None:
        self.path = resolve_model(model_path)
        self.layout: ModelLayout = read_layout(self.path)
        self.layout.check_supported()
        self.model = ModelIdentity.of(self.layout, self.path.name)
        self.keys = str(keys) if keys else None
        self.listen, self.timeout_s = listen, timeout_s
        self.n_ctx, self.n_batch, self.n_ubatch, self.node_threads = n_ctx, n_batch, n_ubatch, node_threads
        self.plan_settings = plan_settings or PlanSettings()
        # speculative decoding: the draft stays on the head, so the plan gives the head's windows less memory
        if draft_model is not None:
            check_draft_length(draft_min, draft_max)
        self.draft_model, self.draft_max, self.draft_min = draft_model, draft_max, draft_min
        self._draft_token_s: float | None = None  # measured when a plan is first made
        self.plan_settings = dataclasses.replace(self.plan_settings, head_reserved_bytes=draft_bytes(
            draft_model, n_ctx, n_batch, n_ubatch))
        self.chat_format = chat_format  # given; else the Llama chooses (engine/chat_formats.py) and it is noticed
        self.events = events or Events()
        self._owns_transport = transport is None
        self.transport = transport or ZmqTransport(load_keys(keys) if keys else None)
        self.nodes: dict[str, NodeEntry] = {a: NodeEntry(a) for a in addresses}
        # the dashboard is one head: what it profiles, the ring it deploys and its watch all name this identity, so
        # the nodes it profiled are already its ring's, and another head is refused while it runs
        self.head = Head()
        self.measured: Measured | None = None
        self.choice: PlanChoice | None = None
        self.llm: Llama | None = None
        self._lock = threading.RLock()
        self._watch = _Watch()
        self.events.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        """A node the head saw fail (the ring, the watcher, a deployment) is not planned with until it answers."""
        if isinstance(event, NodeProgress) and event.state == "failed":
            e = self.entry(event.node)
            if e is not None:
                e.error = event.message

    # --- the nodes -------------------------------------------------------------------------------------------

    def add(self, address: str) -> NodeEntry:
        """Add a node by HOST:PORT (not yet connected)."""
        address = address.strip()
        if ":" not in address or not address.rsplit(":", 1)[1].isdigit():
            raise ConfigError(f"a node's address is HOST:PORT (its control port), got {address!r}")
        with self._lock:
            return self.nodes.setdefault(address, NodeEntry(address))

    def remove(self, address: str) -> None:
        """Forget a node: plans made from now on leave it out (a ring that runs on it runs on until deployed
        again)."""
        with self._lock:
            entry = self.nodes.pop(address, None)
            if entry is not None:
                self.events.publish(NodeProgress(entry.label, "left", 0.0, "removed from the cluster"))

    def entry(self, name: str) -> NodeEntry | None:
        """The node of that name (or address)."""
        return next((e for e in self.nodes.values() if name in (e.name, e.address)), None)

    def usable(self) -> list[NodeEntry]:
        return [e for e in self.nodes.values() if e.name and not e.error]

    def connect(self) -> list[NodeEntry]:
        """Say hello to every node not yet connected; a node that does not answer, or holds another model, is
        marked failed with the reason, and the others go on. Returns the nodes that can be used."""
        with self._lock:
            for e in [e for e in self.nodes.values() if not e.name or e.error]:
                self._hello(e)
            usable = [e for e in self.nodes.values() if e.own and not e.error]
            for e, name in zip(usable, unique_names([(e.own, e.address) for e in usable]), strict=True):
                if e.name != name:
                    e.name = name
                    self.events.publish(NodeProgress(e.name, "connected", 0.0, e.facts))
            return self.usable()

    def _hello(self, e: NodeEntry) -> None:
        self.events.publish(NodeProgress(e.label, "connecting", 0.0, f"connecting to {e.address}"))
        client = NodeClient(self.transport, e.address, self.timeout_s, head=self.head)
        try:
            welcome = client.hello()
        except PrimaplugError as err:
            e.error = (f"{err}. Start it with `primaplug node -m {self.path.name} --listen {e.address}`, then "
                       "connect again")
            self.events.publish(NodeProgress(e.label, "failed", 0.0, e.error))
            return
        finally:
            client.close()
        e.own, e.facts, e.error = welcome.node, describe_device(welcome), ""
        if not can_run(welcome, self.model, head_holds_file=True):
            e.error = (f"holds {held_models(welcome)}, not {self.model.file_name}: restart it with --model pointing "
                       "at the same file as the head's, or with --model-dir to fetch its layers from the head")
            self.events.publish(NodeProgress(e.label, "failed", 0.0, e.error))

    # --- measuring and planning ------------------------------------------------------------------------------

    def _cluster(self, entries: Sequence[NodeEntry]) -> Cluster:
        settings = ClusterSettings(nodes=tuple(e.address for e in entries), n_ctx=self.n_ctx, n_batch=self.n_batch,
                                   n_ubatch=self.n_ubatch, n_threads=self.node_threads, listen=self.listen,
                                   timeout_s=self.timeout_s)
        return Cluster(self.transport, settings, self.model, self.events, self.head, layout=self.layout)

    def profile(self, force: bool = False) -> Measured:
        """Profile the model, the head, every usable node and the ring's links. Once that is done, nodes added
        later are profiled on their own and take the links measured (a ring deployed keeps running); `force`
        measures every device and the links again, which stops a ring deployed (its windows would skew the
        nodes' free memory)."""
        with self._lock:
            entries = self.connect()
            if self.measured is not None and not force:
                return self._profile_new(entries)
            self.undeploy()
            cluster = self._cluster(entries)
            try:
                cluster.connect()
                ps = PlanSettings(**{**self.plan_settings.__dict__, "force_profile": force})
                self.measured = measure(cluster, self.path, self.layout, ps)
            except (NodeError, NodeUnavailableError) as err:
                self._mark_failed(err)
                raise
            finally:
                cluster.close()
            self.choice = None
            return self.measured

    def _profile_new(self, entries: Sequence[NodeEntry]) -> Measured:
        m = self.measured
        assert m is not None
        known = {d.name for d in m.devices}
        new = [e for e in entries if e.name not in known]
        if not new:
            return m
        cluster = self._cluster(new)
        try:
            cluster.connect()
            profiles = cluster.profiles()
        except (NodeError, NodeUnavailableError) as err:
            self._mark_failed(err)
            raise
        finally:
            cluster.close()
        added = tuple(msgspec.structs.replace(p, name=e.name, link_latency_s=m.link_latency_s, link_bps=m.link_bps)
                      for e, p in zip(new, profiles, strict=True))
        self.measured = dataclasses.replace(m, devices=(*m.devices, *added))
        return self.measured

    def devices(self) -> tuple[DeviceProfile, ...]:
        """The measured devices a plan may use: the head, then the usable nodes in the order they were given."""
        m = self.measured
        if m is None:
            return ()
        by_name = {d.name: d for d in m.devices[1:]}
        return (m.devices[0], *(by_name[e.name] for e in self.usable() if e.name in by_name))

    def _mark_failed(self, err: NodeError | NodeUnavailableError) -> None:
        """Publish a node's failure (its entry takes the reason from the event, _on_event), or that another head
        holds it (taken: T takes it over); a NodeError names the node as "name (address)"."""
        state = "taken" if isinstance(err, NodeHeldError) else "failed"
        self.events.publish(NodeProgress(err.node.split(" (")[0], state, 0.0, str(err)))

    def plan(self, request: PlanRequest) -> PlanChoice:
        """The plan for the measured devices (profile() first), and the alternatives the scheduler weighed."""
        with self._lock:
            m, devices = self.measured, self.devices()
            if m is None:
                raise ConfigError("nothing is measured yet: profile the nodes first")
            if request.scheduler not in PLANNERS:
                raise ConfigError(f"unknown scheduler {request.scheduler!r}: choose one of {', '.join(PLANNERS)}")
            ps = self.plan_settings
            common: dict[str, Any] = dict(slow_disk_bps=ps.slow_disk_bps, latency_model=ps.latency_model)
            nodes = len(devices) - 1
            try:
                if request.scheduler in SCHEDULERS:
                    plan = solve(devices, m.model, scheduler=request.scheduler, rounds=request.rounds,  # type: ignore[arg-type]
                                 **common)
                    others = tuple(alternatives(devices, m.model, scheduler=request.scheduler,  # type: ignore[arg-type]
                                                **common))
                else:
                    k = request.rounds or 1
                    if request.scheduler == "even":
                        if nodes < 1:
                            raise ConfigError("an even split needs at least one node")
                        if m.model.n_layer % k:
                            raise ConfigError(f"the rounds must divide the model's {m.model.n_layer} layers, got {k}")
                        sizes = even_sizes(m.model.n_layer, nodes, k, m.model.tail_layers, m.model.barred_starts)
                    else:
                        sizes = list(request.layers)
                    gpu = [request.gpu_layers] * nodes
                    check_gpu_layers(devices, m.model, sizes, gpu, rounds=k)  # before a node refuses it
                    plan = placement(devices, m.model, sizes, rounds=k, gpu_layers=gpu, scheduler=request.scheduler,
                                     **common)
                    others = ()
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if self.draft_model is not None:
                plan = plan_with_speculation(plan, self._draft_speed(), self.draft_min, self.draft_max)
            self.choice = PlanChoice(request, plan, others)
            self.events.publish(Planned(plan.describe()))
            return self.choice

    def _draft_speed(self) -> float:
        """Seconds a drafted token costs on the head (measured once)."""
        if self._draft_token_s is None:
            from primaplug.engine.speculative import measure_draft

            self.events.publish(Notice("timing the draft model on the head"))
            self._draft_token_s = measure_draft(self.draft_model, n_ctx=self.n_ctx, n_batch=self.n_batch,
                                                n_threads=0)
        return self._draft_token_s

    # --- running ---------------------------------------------------------------------------------------------

    def take_over(self, then: Callable[[], Any]) -> Any:
        """Run `then` (profile, plan, deploy) taking the nodes from whichever head holds them, on purpose (T in the
        dashboard); that head reports them taken and takes them back once this one lets them go."""
        with self._lock:
            self.head.take_over = True
            try:
                return then()
            finally:
                self.head.take_over = False

    def deploy(self, plan: Plan | None = None, **llama_kwargs: Any) -> Llama:
        """Deploy a plan (default: the last one made) as a primaplug.Llama; a ring deployed before is stopped."""
        from primaplug.head.llama import Llama

        with self._lock:
            plan = plan or (self.choice.plan if self.choice else None)
            if plan is None:
                raise ConfigError("no plan to deploy: make one first")
            self.undeploy()
            names = {d.name for d in plan.devices}
            addresses = [e.address for e in self.usable() if e.name in names]
            self.events.publish(Notice(f"deploying {plan.scheduler}'s plan: {plan.k} round(s) over "
                                       f"{len(addresses)} node(s) and the head"))
            for name, value in (("n_ctx", self.n_ctx), ("n_batch", self.n_batch), ("n_ubatch", self.n_ubatch)):
                llama_kwargs.setdefault(name, value)
            llama_kwargs.setdefault("verbose", False)
            if self.chat_format:
                llama_kwargs.setdefault("chat_format", self.chat_format)
            # a plan of the head alone (Halda found the nodes slower) with GPU layers keeps its windows and their
            # GPU layers; without, the head runs one window
            alone = (not addresses and len(plan.devices) == 1 and plan.head.n > 0
                     and plan.head.w * plan.k == self.layout.n_layer)
            if alone:
                llama_kwargs.setdefault("rounds", plan.k)
                llama_kwargs.setdefault("node_gpu_layers", plan.head.n)
            try:
                self.llm = Llama(self.path, nodes=addresses, plan=plan if addresses else None,
                                 layers=None if addresses else [plan.head.w if alone else self.layout.n_layer],
                                 keys=self.keys,
                                 listen=self.listen, timeout_s=self.timeout_s, node_threads=self.node_threads,
                                 events=self.events, transport=self.transport, draft_model=self.draft_model,
                                 draft_max=self.draft_max, draft_min=self.draft_min, head=self.head,
                                 take_over=self.head.take_over, **llama_kwargs)
            except (NodeError, NodeUnavailableError) as err:
                self._mark_failed(err)
                raise
            self.llm.plan = plan  # the head alone is not deployed from the plan: keep it all the same
            chosen = getattr(self.llm, "chat_format_reason", "")  # what the Llama chose (engine/chat_formats.py)
            if chosen and self.text_mode:
                self.events.publish(Notice(f"each message is continued as text: {chosen}; to chat in the format "
                                           f"it suggests, pass --chat-format {self.llm.chat_format}"))
            elif chosen:
                self.events.publish(Notice(f"chat format: {self.llm.chat_format} ({chosen})"))
            return self.llm

    def undeploy(self) -> None:
        """Stop the ring: the nodes free their windows and keep running, free for any head."""
        with self._lock:
            if self.llm is not None:
                self.llm.close()
                self.llm = None

    @property
    def text_mode(self) -> bool:
        """Whether each message is continued as text rather than chatted: for a model with no chat template of its
        own and none given. The bundled Gemma 3 270M is a base model, which answered "What is the capital of
        France?" in the gemma format its tokenizer names with the question and "wnętr", eight times over, and as
        text with "The capital of France is Paris." (plain llama-cpp-python alike)."""
        return not self.chat_format and not self.layout.has_chat_template

    def chat(self, messages: list[dict[str, str]], *, temperature: float = 0.0, max_tokens: int = 128,
             seed: int | None = None, stop: threading.Event | None = None) -> Iterator[str]:
        """Stream the assistant's reply through the ring with the model's chat template or the format given, or, in
        text mode (neither), the continuation of the last message as text; `stop` ends it between two tokens."""
        with self._lock:
            if self.llm is None:
                raise ConfigError("no ring is deployed: deploy a plan first")
            text_mode = self.text_mode
            if text_mode:
                stream = self.llm.create_completion(messages[-1]["content"], temperature=temperature,
                                                    max_tokens=max_tokens, seed=seed, stream=True)
            else:
                stream = self.llm.create_chat_completion(messages, temperature=temperature, max_tokens=max_tokens,
                                                         seed=seed, stream=True)
            for chunk in stream:
                choice = chunk["choices"][0]  # type: ignore[index]
                text = choice["text"] if text_mode else choice["delta"].get("content")
                if text:
                    yield text
                if stop is not None and stop.is_set():
                    stream.close()  # type: ignore[union-attr]
                    return

    # --- watching --------------------------------------------------------------------------------------------

    def watch(self) -> None:
        """Ask every usable node how it is (with its memory figures while a ring runs) and publish it: NodeMetrics
        with its busy share, or a failure when it stopped answering, or its return when it answers again. Only
        the watcher thread calls this; it has its own connections."""
        deployed = self.llm is not None
        for e in list(self.nodes.values()):
            if not e.name:
                continue
            client = self._watch.clients.get(e.address)
            if client is None:
                client = self._watch.clients[e.address] = NodeClient(self.transport, e.address, self.timeout_s + 2.0,
                                                                     head=self.head)
                client.name = e.name
            try:
                status = client.status(detail=deployed)
            except NodeUnavailableError as err:
                if e.name not in self._watch.down:
                    self._watch.down.add(e.name)
                    if not e.error:  # not yet seen failing by the ring or a command
                        self.events.publish(NodeProgress(e.name, "failed", 0.0, f"{err}. Restart it, then connect "
                                                         "again (c); or remove it (x) and plan without it"))
                continue
            except PrimaplugError as err:
                log.warning("watching %s: %s", e.label, err)
                continue
            if e.name in self._watch.down:  # back: a restarted node holds no windows; deploy again
                self._watch.down.discard(e.name)
                e.error = ""
                self.events.publish(NodeProgress(e.name, "connected", 0.0, f"answers again ({status.state}); "
                                                 "deploy again to use it"))
            by = client.taken_by(status)
            holder = by.head.id if by is not None else None
            if holder != self._watch.held.get(e.name):  # held by another head, or free again: say so once
                self._watch.held[e.name] = holder
                if by is not None:
                    self.events.publish(NodeProgress(e.name, "taken", 0.0, f"held by {by.describe()}: T takes it "
                                                     "over"))
                elif not deployed:
                    self.events.publish(NodeProgress(e.name, "connected", 0.0, "free again"))
            self.events.publish(NodeMetrics(e.name, status, self._busy_share(e.name, status)))

    def _busy_share(self, name: str, status: Status) -> float:
        now = time.monotonic()
        before = self._watch.busy.get(name)
        self._watch.busy[name] = (now, status.busy_s)
        if before is None or now <= before[0]:
            return 0.0
        return max(0.0, min(1.0, (status.busy_s - before[1]) / (now - before[0])))

    def close_watch(self) -> None:
        for c in self._watch.clients.values():
            c.close()
        self._watch.clients.clear()

    def close(self, timeout_s: float | None = None, *, watcher_stopped: bool = True) -> None:
        """Stop the ring and disconnect (the nodes keep running). With a timeout, a command still under way after
        it is left to the process's exit, with a warning; so are the sockets of a watcher that has not stopped."""
        if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            log.warning("a cluster command was still under way after %.0f s; leaving it to the exit", timeout_s)
            return
        try:
            self.undeploy()
            if watcher_stopped:
                self.close_watch()
                if self._owns_transport:
                    self.transport.close()
        finally:
            self._lock.release()
