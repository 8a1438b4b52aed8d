"""primaplug.Llama: a llama_cpp.Llama whose layers run on a ring of primaplug nodes.

    import primaplug
    llm = primaplug.Llama("gemma-3-270m.gguf", nodes=["127.0.0.1:7000", "127.0.0.1:7010"], n_ctx=2048)
    print(llm("The capital of France is", max_tokens=16)["choices"][0]["text"])

It composes the head: a transport, the cluster (connects, plans, deploys), the head's own windows (on the device
layer, as a node runs its own), the ring, the session that owns the conversation, and llama-cpp-python's front
(engine/ring_llama.py). Without nodes, the head runs every window itself: the same path, with no network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from primaplug.core.errors import ConfigError
from primaplug.core.settings import DRAFT_MAX, DRAFT_MIN, MAX_PARALLEL, RunSettings, head_threads
from primaplug.decoding import check_draft_length
from primaplug.device import DeviceWindows, MemorySettings
from primaplug.engine import BUSY_POLL, ContextSettings, read_layout
from primaplug.engine.ring_llama import RingLlama
from primaplug.engine.speculative import Speculation, draft_token_seconds, open_speculation
from primaplug.head.batching import Batcher
from primaplug.head.cluster import Cluster, ClusterSettings, Route
from primaplug.head.events import Events, Notice, Reformed
from primaplug.head.identity import Head
from primaplug.head.planning import PlanSettings, draft_bytes, measure, plan_cluster, plan_with_speculation
from primaplug.head.recovery import Driver, Recovery, Replanner
from primaplug.head.session import Session
from primaplug.head.slots import Slots
from primaplug.memory.prefetcher import Switches
from primaplug.profiler import compute_buffer_output_bytes
from primaplug.scheduler import SCHEDULERS, Plan
from primaplug.store import resolve_model
from primaplug.transport import Transport, ZmqTransport, load_keys
from primaplug.wire import ModelIdentity

log = logging.getLogger(__name__)
_RUN = RunSettings()


class Llama(RingLlama):
    """Behaves as llama_cpp.Llama; the model's layers run on `nodes` (HOST:PORT of `primaplug node`s).

    Args:
        model_path: the GGUF file (or `hf://ORG/REPO/FILE.gguf`, `ORG/REPO:QUANT`, a part of a model in several
            files: store/hub.py); a node holds the same file (checked by hash), or fetches the layers it runs from
            this head (a node started with --model-dir: docs/distribute.md).
        nodes: the nodes' control addresses, in ring order. None or empty: the head runs every layer itself.
        layers: layers per round for each node, then optionally for the head: a manual split (no planning).
            Without nodes: the sizes of the windows the head chains (a split in one process).
        plan: a plan made beforehand for these nodes (by the dashboard, say: `Coordinator.plan`), deployed as it is,
            with nothing measured; its devices are the head and the nodes by name, and nodes it dropped leave.
        scheduler: with nodes and without layers, how the windows are chosen: "halda" (default: profile every
            device, measure the links, solve prima.cpp's scheduler, drop nodes that would slow the ring), the
            baselines "memory" (exo's rule) or "compute" (Galaxy's), or "even" (split evenly, nothing measured).
        rounds: how many times a token goes round the ring (each device runs one window per round); None: the
            scheduler's choice (Halda picks k), or 1 for a manual or even split.
        plan_settings: finer planning settings (latency model, slow-disk threshold, re-measuring).
        keys: the cluster key file (`primaplug keygen`); required when any node is off this machine.
        listen: the address the head receives the ring's output on.
        timeout_s: how long a silent node may take before generation stops with an error naming it.
        node_threads: compute threads on each node (0: all its cores).
        node_gpu_layers: layers of each node window that run on the node's GPU, one number for every node or
            one per node; with a split by hand only (layers, or "even"). Without nodes, one number: layers of each
            of the head's windows on this device's GPU (-ngl). A node, or this device, whose engine has no GPU
            refuses GPU layers, saying so; a planning scheduler gives a head with a GPU its GPU layers itself.
        stream_rooms: with a split by hand, per node, how many layers of room a node that streams leaves beside
            the part of every layer it keeps (0: its own rule, a window's layers and one); a planning scheduler
            chooses them from the ring's timing (scheduler/rooms.py, docs/memory.md).
        memory_budget: bytes the head's own windows' weights may use (default: what this device has available,
            less KV cache, buffers, the output layer and 5%); windows that do not fit are streamed, as on a node.
            A planning scheduler sees it as the head's available memory (PlanSettings.head_memory_bytes), so the
            plan puts on the nodes what the head does not hold.
        memory_switches: which parts of the memory policy the head's own windows use (prefetch, release, keep,
            layer by layer: None lets the plan choose), as a node's --no-prefetch, --no-release, --no-keep and
            --layer-streaming on|off: ablations.
        events: where the cluster and the session publish what they do (head/events.py); `llm.events.view` is the
            cluster's latest snapshot either way.
        transport: the transport to reach the nodes over (default: ZeroMQ, with `keys`); the caller keeps
            ownership of one it passes.
        route: maps (the sending node's address or "head", endpoint) to the endpoint it connects to instead (an
            emulated link in between).
        draft_model: speculative decoding: a small GGUF of the same family (the same tokenizer), which the head
            runs itself, "prompt-lookup" (drafts from the conversation itself, no model), or any llama-cpp-python
            LlamaDraftModel. The
            head drafts tokens and the ring verifies them all in one trip; the output is the target's (greedy:
            the same tokens; sampling: the same distribution, by speculative sampling). `llm.speculation.stats`
            says how many drafted tokens were kept.
        draft_max, draft_min: the most and fewest tokens drafted a step (llama.cpp's --draft-max, --draft-min);
            in between, the length follows the measured acceptance rate and the cost of drafting against a trip.
        n_parallel: requests in flight at once (llama.cpp's --parallel): every window's cache holds this many
            sequences of n_ctx positions each, counted in every device's memory plan. create_completion,
            create_chat_completion and __call__ may then be called from as many threads at once: each call takes
            a free sequence for its whole duration (a stream: until it ends or is closed), preferring the one
            that holds the longest prefix of its prompt, and waits while all are busy. Their steps go round the
            ring together (head/batching.py); each gets the tokens it gets alone.
        ring_trips: trips in the ring at once when several requests are in flight (0: one per device, or one when
            a device streams its windows, so that a window streamed once serves every request waiting at it).
        take_over: deploy even on nodes that another head holds (a node belongs to the head that deployed it while
            that head runs: another head is refused, naming it). That head then reports its nodes taken over and
            waits; it takes them back once this Llama closes. Only the first deployment takes over: re-formings
            never do.
        head: this head's identity as the nodes know it (default: a new one); the dashboard's coordinator passes its
            own, so that the nodes it profiled are already its Llama's.
        node_candidates: addresses of nodes that may join while this Llama runs, asked at every heartbeat (the nodes
            found on the network: primaplug.discovery). Whatever the source, a node lost from the ring that answers
            again rejoins, and a node that restarts is loaded again: the ring is re-planned and deployed when no
            request runs, or when a request finds it broken (head/recovery.py; `llm.reforms` lists each time).
        **kwargs: llama_cpp.Llama's own arguments (n_ctx, n_batch, n_ubatch, n_threads, seed, chat_format, ...);
            n_ctx, n_batch and n_ubatch default to primaplug's RunSettings (4096, 512, 512).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        nodes: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        plan: Plan | None = None,
        scheduler: str = "halda",
        rounds: int | None = None,
        plan_settings: PlanSettings | None = None,
        keys: str | os.PathLike[str] | None = None,
        listen: str = _RUN.listen,
        timeout_s: float = _RUN.timeout_s,
        node_threads: int = _RUN.node_threads,
        node_gpu_layers: int | Sequence[int] = 0,
        stream_rooms: Sequence[int] | None = None,
        memory_budget: int | None = None,
        memory_switches: Switches | None = None,
        events: Events | None = None,
        transport: Transport | None = None,
        route: Route | None = None,
        draft_model: Any = None,
        draft_max: int = DRAFT_MAX,
        draft_min: int = DRAFT_MIN,
        n_parallel: int = _RUN.n_parallel,
        ring_trips: int = _RUN.ring_trips,
        node_candidates: Callable[[], Sequence[str]] | None = None,
        take_over: bool = False,
        head: Head | None = None,
        **kwargs: Any,
    ) -> None:
        nodes = tuple(nodes or ())
        if not 1 <= n_parallel <= MAX_PARALLEL:
            raise ConfigError(f"n_parallel (--parallel) is the number of requests in flight: 1 to {MAX_PARALLEL}, "
                              f"got {n_parallel}")
        if n_parallel > 1 and draft_model is not None:
            raise ConfigError("speculative decoding (a draft model) serves one request at a time for now: use "
                              "n_parallel 1 (--parallel 1) with a draft, or no draft with several in flight")
        if ring_trips < 0:
            raise ConfigError(f"ring_trips must be 0 (one per device) or more, got {ring_trips}")
        if scheduler not in (*SCHEDULERS, "even"):
            raise ConfigError(f"unknown scheduler {scheduler!r}: choose halda, memory, compute or even")
        if plan is not None and (layers is not None or not nodes):
            raise ConfigError("a plan is deployed on its own nodes: pass nodes, and no layers")
        planned = bool(nodes) and layers is None and scheduler != "even" and plan is None
        gpu = tuple(node_gpu_layers) if isinstance(node_gpu_layers, Sequence) else (node_gpu_layers,) * len(nodes)
        head_gpu = 0 if nodes or isinstance(node_gpu_layers, Sequence) else int(node_gpu_layers)  # the head alone
        if not nodes and (gpu or head_gpu < 0):
            raise ConfigError(f"without nodes, node_gpu_layers (-ngl) is one count (0 or more): the layers of each of "
                              f"the head's windows on this device's GPU; got {node_gpu_layers!r}")
        if len(gpu) != len(nodes) or min(gpu, default=0) < 0:
            raise ConfigError(f"node_gpu_layers needs one count (0 or more) per node ({len(nodes)}), or one for "
                              f"every node; got {list(gpu)}")
        rooms = tuple(stream_rooms or ())
        if rooms and (len(rooms) != len(nodes) or min(rooms) < 0 or planned or plan is not None):
            raise ConfigError(f"stream_rooms is one count of layers (0 or more) per node ({len(nodes)}), for a split "
                              f"by hand (layers, or scheduler 'even'): a plan chooses its own; got {list(rooms)}")
        if planned and any(gpu):
            raise ConfigError(f"node_gpu_layers (-ngl) is for a split by hand (layers / --layers, or scheduler "
                              f"'even'): the {scheduler} scheduler picks each device's GPU layers from its profile")
        if draft_model is not None:
            check_draft_length(draft_min, draft_max)
        path = resolve_model(model_path)  # a Hugging Face reference, a model in several files: store/hub.py
        layout = read_layout(path)
        layout.check_supported()
        # a rejected draft's tokens are forgotten from the recurrent states' snapshots, one a drafted token
        rollback = draft_max if draft_model is not None and layout.has_recurrent_layers else 0
        if rollback and not layout.can_roll_back:
            raise ConfigError(f"{path.name} has recurrent layers ({layout.arch}), whose states llama.cpp cannot roll "
                              "back past a rejected draft's tokens: run it without a draft model (--draft). Qwen 3.5 "
                              "and LFM2 can")
        for name in ("n_ctx", "n_batch", "n_ubatch"):
            kwargs.setdefault(name, getattr(_RUN, name))
        n_ctx = kwargs["n_ctx"] or layout.n_ctx_train
        n_batch = kwargs["n_batch"] = min(n_ctx, kwargs["n_batch"])
        n_ubatch = kwargs["n_ubatch"] = min(n_batch, kwargs["n_ubatch"])
        if n_parallel > n_batch:  # llama.cpp sizes a context's outputs by n_batch and asserts on more sequences
            raise ConfigError(f"n_parallel ({n_parallel}) cannot exceed n_batch ({n_batch}): every sequence in flight "
                              "needs a row of a batch; raise n_batch (-b) or lower --parallel")
        kwargs["n_threads"] = threads = head_threads(kwargs.get("n_threads") or 0, bool(nodes))
        self.events = events or Events()
        self.head = head or Head()
        self.head.take_over = take_over
        self._owns_transport = transport is None
        self._transport: Transport | None = transport or ZmqTransport(load_keys(keys) if keys else None)
        settings = ClusterSettings(nodes=nodes, layers=tuple(layers) if layers else None, rounds=rounds or 1,
                                   n_ctx=n_ctx, n_parallel=n_parallel, n_batch=n_batch, n_ubatch=n_ubatch,
                                   n_threads=node_threads,
                                   listen=listen, timeout_s=timeout_s, route=route, gpu_layers=gpu,
                                   head_gpu_layers=head_gpu, stream_rooms=rooms or None, n_rs_seq=rollback)
        self._cluster: Cluster | None = None
        self._device: DeviceWindows | None = None
        self.plan: Plan | None = None  # the scheduler's plan, when one was made
        self.speculation: Speculation | None = None
        # the draft's weights, KV cache and buffers stay on the head: less memory for the head's windows
        reserved = draft_bytes(draft_model, n_ctx, n_batch, n_ubatch)
        try:
            self._cluster = cluster = Cluster(self._transport, settings, ModelIdentity.of(layout, path.name),
                                              self.events, self.head, layout=layout)
            cluster.connect()
            if plan is not None:
                self.plan = plan
                cluster.apply_given_plan(plan)
            elif planned:
                ps = dataclasses.replace(plan_settings or PlanSettings(), scheduler=scheduler, rounds=rounds,
                                         head_reserved_bytes=reserved)
                if memory_budget is not None and ps.head_memory_bytes is None:
                    ps = dataclasses.replace(ps, head_memory_bytes=memory_budget)
                measured = measure(cluster, path, layout, ps)
                self.plan = plan_cluster(cluster, measured, ps)
                log.info("%s", self.plan.describe())
            else:
                cluster.plan()
            # the head's windows live on the device layer, as a node's do: same memory plan, same prefetch hooks
            context = ContextSettings(n_ctx=n_ctx * n_parallel, n_batch=n_batch, n_ubatch=n_ubatch,
                                      n_threads=threads, poll=BUSY_POLL, n_seq_max=n_parallel, n_rs_seq=rollback,
                                      row_end=cluster.row_end)
            self._device = DeviceWindows.load(
                path, layout, cluster.head_ranges, context=context,
                memory=MemorySettings(budget_bytes=memory_budget, switches=memory_switches or Switches()),
                output=True, extra_reserved=compute_buffer_output_bytes(layout, n_ctx, n_batch, n_ubatch) + reserved,
                extra_weights=layout.output_bytes, gpu_layers=cluster.head_gpu_layers())
            self._device.warm_up()
            if draft_model is not None:
                self.speculation = open_speculation(draft_model, target=self._device.model, n_ctx=n_ctx,
                                                    n_batch=n_batch, n_threads=threads, n_min=draft_min,
                                                    n_max=draft_max)
                if self.plan is not None and self.plan.speculation is None:  # a plan given may carry it already
                    probe = self._device.model.tokenize("The ring verifies what the head drafts.")
                    self.plan = plan_with_speculation(self.plan, draft_token_seconds(self.speculation.source, probe),
                                                      draft_min, draft_max)
                    self.events.publish(Notice(self.plan.speculation.describe()))  # type: ignore[union-attr]
            replanner = Replanner.of(cluster, measured, ps) if planned else Replanner.of(cluster, None, None)
            cluster.deploy()
            self.head.take_over = False  # taken once, on purpose; never again behind the user's back
            model = self._device.model
            output = model.window(layout.n_layer, layout.n_layer, settings=dataclasses.replace(
                context, n_ctx=n_ctx, n_seq_max=1, poll=0))
            entry = model.window(0, 0, output_hidden=True, settings=dataclasses.replace(context, poll=0)) \
                if layout.input_window else None

            def open_ring(c: Cluster) -> Batcher:
                return Batcher(c.ring(self._device, entry), output, n_batch=n_batch, trips=ring_trips,
                               streams=ring_trips == 0 and n_parallel > 1 and self._streams())

            # a node lost, restarted or joined re-forms the ring (head/recovery.py); requests replay onto it
            self._recovery = Recovery(cluster, open_ring(cluster), open_ring, replanner,
                                      idle=lambda: self._slots.running == 0, candidates=node_candidates)
            rewindable = not layout.has_recurrent_layers
            self.session = Session(self._batcher, n_batch=n_batch, events=self.events, reform=self._recovery,
                                   rewindable=rewindable, rollback=rollback)
            super().__init__(model, self.session, speculation=self.speculation, **kwargs)
            # the other sequences: a llama-cpp-python front each (its sampler, its prefix), on the same ring
            self._slots = Slots([self] + [
                RingLlama(model, Session(self._batcher, n_batch=n_batch, events=self.events, seq_id=i,
                                         reform=self._recovery, rewindable=rewindable, rollback=rollback),
                           **kwargs)
                for i in range(1, n_parallel)])
        except BaseException:
            self._close_ring()
            raise

    def _streams(self) -> bool:
        """Whether any device of the ring (the head included) streams its windows from disk."""
        assert self._device is not None and self._cluster is not None
        # a node's memory_mode: "" for a relay, "resident (no windowing)", else how it pages streamed windows in
        return self._device.plan.prefetch.mode == "stream" or any(
            n.status(detail=True).memory_mode not in ("", "resident (no windowing)") for n in self._cluster.nodes)

    @property
    def n_parallel(self) -> int:
        """Requests this Llama serves at once (sequences on the ring)."""
        return self._slots.size

    @property
    def requests_running(self) -> int:
        """Calls that hold a sequence now."""
        return self._slots.running

    @property
    def requests_waiting(self) -> int:
        """Calls waiting for a free sequence."""
        return self._slots.waiting

    @property
    def _batcher(self) -> Driver:
        """The ring's driver now (a re-formed ring has a new one; a broken one while it cannot be)."""
        return self._recovery.current()

    @property
    def reforms(self) -> list[Reformed]:
        """Every time the ring was re-formed (nodes lost, restarted or joined), with where the time went."""
        return list(self._recovery.reports)

    @contextlib.contextmanager
    def _sequence(self, prompt: str | Sequence[int]) -> Iterator[RingLlama]:
        """A free sequence for this prompt, held until the block ends; this Llama's own is one of them. At a request
        boundary (none running), a ring the heartbeat found broken or joined is re-formed first."""
        self._recovery.at_boundary()
        slot = self._slots.acquire(prompt, self.tokenize)
        try:
            yield slot
        finally:
            self.head.served += 1  # the nodes hear it with the next request (who holds them, and what it did)
            self._slots.release(slot)
            self._batcher.idle(slot._session.seq_id)

    def _create_completion(self, prompt: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Every completion (create_completion, create_chat_completion, __call__) runs on a free sequence, which
        it holds until it ends."""
        with self._sequence(prompt) as slot:
            if slot is self:
                yield from super()._create_completion(prompt, *args, **kwargs)
            else:
                yield from slot._create_completion(prompt, *args, **kwargs)

    def embed(self, input: str | list[str], *args: Any, **kwargs: Any) -> Any:  # noqa: A002 (llama-cpp-python's name)
        """llama_cpp.Llama.embed, on a free sequence (create_embedding comes here too)."""
        with self._sequence(input if isinstance(input, str) else (input[0] if input else "")) as slot:
            return super().embed(input, *args, **kwargs) if slot is self else slot.embed(input, *args, **kwargs)

    def ring_problem(self) -> str | None:
        """None when the ring serves, or can be re-formed from the nodes there are (the heartbeat watches them);
        else what is wrong, in a sentence. Asks no node: it costs nothing on a request's way."""
        if self._cluster is None:
            return "this Llama is closed"
        return self._recovery.problem()

    @property
    def cluster(self) -> Cluster:
        assert self._cluster is not None, "this Llama is closed"
        return self._cluster

    def _close_ring(self) -> None:
        if getattr(self, "_recovery", None) is not None:
            self._recovery.close()  # its heartbeat, and the ring's driver
            self._recovery = None
        for slot in getattr(self, "_slots", Slots([])).others(self):
            slot.close()
        if getattr(self, "speculation", None) is not None:
            self.speculation.close()  # type: ignore[union-attr]
            self.speculation = None
        if getattr(self, "_device", None) is not None:
            self._device.close()  # type: ignore[union-attr]
            self._device = None
        if getattr(self, "_cluster", None) is not None:
            self._cluster.close()  # type: ignore[union-attr]
            self._cluster = None
        if getattr(self, "_transport", None) is not None:
            if self._owns_transport:
                self._transport.close()  # type: ignore[union-attr]
            self._transport = None

    def close(self) -> None:
        """Disconnect from the nodes (they keep running, ready for another head) and free the head's model."""
        if getattr(self, "_stack", None) is not None:
            super().close()
        self._close_ring()
