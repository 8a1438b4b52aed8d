"""primaplug.Llama: a llama_cpp.Llama whose layers run on a ring of primaplug nodes.

    import primaplug
    llm = primaplug.Llama("gemma-3-270m.gguf", nodes=["127.0.0.1:7000", "127.0.0.1:7010"], n_ctx=2048)
    print(llm("The capital of France is", max_tokens=16)["choices"][0]["text"])

This module composes the parts: a Transport, a Cluster (deploys windows to the nodes), the planner (profiles
and Halda, planning.py), the head's own model (vocabulary, its windows, the output layer), the RingHead, and the
llama-cpp-python front (RingLlama).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from primaplug.coordinator import Cluster, ClusterSettings
from primaplug.coordinator.cluster import Progress, Route
from primaplug.core.errors import ConfigError
from primaplug.core.windows import LayerRange
from primaplug.engine import ContextSettings, Model, ModelLayout, Window, read_layout
from primaplug.engine.ring_llama import RingLlama
from primaplug.memory.policy import PrefetchPlan, plan_prefetch, repack_allowed
from primaplug.memory.prefetcher import Prefetcher
from primaplug.memory.system import memory_view
from primaplug.node.deployment import reserved_bytes, weights_budget
from primaplug.planning import PlanSettings, measure, plan_cluster
from primaplug.scheduler import SCHEDULERS, Plan
from primaplug.transport import Transport, load_keys
from primaplug.wire import ModelIdentity

log = logging.getLogger(__name__)


class Llama(RingLlama):
    """Behaves as llama_cpp.Llama; the model's layers run on `nodes` (HOST:PORT of `primaplug node`s).

    Args:
        model_path: the GGUF file; every node must hold the same file (checked by hash).
        nodes: the nodes' control addresses, in ring order.
        layers: layers per round for each node, then optionally for the head: a manual split (no planning).
        scheduler: without layers, how the windows are chosen: "halda" (default: profile every device, measure
            the links, solve prima.cpp's scheduler, drop nodes that would slow the ring), the baselines "memory"
            (layers in proportion to memory, exo's rule) or "compute" (to compute speed, Galaxy's), or "even"
            (split evenly over the nodes, nothing measured).
        rounds: how many times a token goes round the ring (each device runs one window per round); None: the
            scheduler's choice (Halda picks k with the ring's latency model), or 1 for a manual or even split.
        plan_settings: finer planning settings (latency model, slow-disk threshold, profile cache, re-measuring).
        keys: the cluster key file (`primaplug keygen`); required when any node is off this machine.
        listen: the address the head receives the ring's output on.
        timeout_s: how long a silent node may take before generation stops with an error naming it.
        node_threads: compute threads on each node (0: all its cores).
        node_gpu_layers: layers of each node window that run on the node's GPU, one number for every node or
            one per node (the first layers of each window); with a split by hand only (layers, or "even"): the
            other schedulers choose GPU layers themselves.
        progress: called with (node, fraction, message) while the nodes load.
        memory_budget: bytes the head's own windows' weights may use (default: what this device has available,
            less KV cache, buffers, the output layer and 5%); windows that do not fit are streamed, as on a node.
        route: maps (the sending node's address or "head", endpoint) to the endpoint it connects to instead (an
            emulated link in between).
        **kwargs: llama_cpp.Llama's own arguments (n_ctx, n_batch, n_ubatch, n_threads, seed, chat_format, ...).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        nodes: Sequence[str],
        layers: Sequence[int] | None = None,
        scheduler: str = "halda",
        rounds: int | None = None,
        plan_settings: PlanSettings | None = None,
        keys: str | os.PathLike[str] | None = None,
        listen: str = "127.0.0.1",
        timeout_s: float = 5.0,
        node_threads: int = 0,
        node_gpu_layers: int | Sequence[int] = 0,
        progress: Progress | None = None,
        route: Route | None = None,
        memory_budget: int | None = None,
        **kwargs: Any,
    ) -> None:
        if scheduler not in (*SCHEDULERS, "even"):
            raise ConfigError(f"unknown scheduler {scheduler!r}: choose halda, memory, compute or even")
        planned = layers is None and scheduler != "even"
        gpu = tuple(node_gpu_layers) if isinstance(node_gpu_layers, Sequence) else (node_gpu_layers,) * len(nodes)
        if len(gpu) != len(nodes) or min(gpu, default=0) < 0:
            raise ConfigError(f"node_gpu_layers needs one count (0 or more) per node ({len(nodes)}), or one for "
                              f"every node; got {list(gpu)}")
        if planned and any(gpu):
            raise ConfigError(f"node_gpu_layers (-ngl) is for a split by hand (layers / --layers, or scheduler "
                              f"'even'): the {scheduler} scheduler picks each device's GPU layers from its profile")
        path = Path(model_path)
        layout = read_layout(path)
        layout.check_supported()
        n_ctx = kwargs.get("n_ctx", 512) or layout.n_ctx_train
        n_batch = min(n_ctx, kwargs.get("n_batch", 512))
        n_ubatch = min(n_batch, kwargs.get("n_ubatch", 512))
        self._transport = Transport(load_keys(keys) if keys else None)
        ident = ModelIdentity.of(layout, path.name)
        settings = ClusterSettings(nodes=tuple(nodes), layers=tuple(layers) if layers else None, rounds=rounds or 1,
                                   n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=node_threads,
                                   listen=listen, timeout_s=timeout_s, route=route, gpu_layers=gpu)
        self._cluster: Cluster | None = None
        self._head_model: Model | None = None
        self._prefetcher: Prefetcher | None = None
        self.plan: Plan | None = None  # the scheduler's plan, when one was made
        try:
            self._cluster = cluster = Cluster(self._transport, settings, ident)
            cluster.connect()
            if planned:
                ps = dataclasses.replace(plan_settings or PlanSettings(), scheduler=scheduler, rounds=rounds)
                say = (lambda what: progress("planner", 0.0, what)) if progress else (lambda _: None)
                self.plan = plan_cluster(cluster, measure(cluster, path, layout, ps, say), ps)
                log.info("%s", self.plan.describe())
            else:
                cluster.plan()
            head_windows = [r for r in cluster.head_ranges if r.n_layers]
            memory, repack = _head_memory_plan(layout, head_windows, n_ctx, n_batch, n_ubatch, memory_budget)
            self._head_model = head = Model(path, head_windows, output=True, layout=layout, repack=repack)
            cluster.deploy(progress)
            threads = kwargs.get("n_threads") or max(1, (os.cpu_count() or 2) // 2)  # llama_cpp.Llama's default
            ctx = ContextSettings(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads)
            windows: list[Window | _StreamedWindow | None] = list(head.round_windows(cluster.head_ranges, settings=ctx))
            if memory.mode == "stream":
                self._prefetcher = Prefetcher(str(path), memory)
                streamed = [i for i, w in enumerate(windows) if w is not None]
                windows = [_StreamedWindow(w, self._prefetcher, streamed.index(i), i == streamed[-1])
                           if w is not None else None for i, w in enumerate(windows)]
            super().__init__(head, cluster.ring(windows), **kwargs)
        except BaseException:
            self._close_ring()
            raise

    @property
    def cluster(self) -> Cluster:
        assert self._cluster is not None
        return self._cluster

    def _close_ring(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._head_model is not None:
            self._head_model.close()
            self._head_model = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None  # type: ignore[assignment]

    def close(self) -> None:
        """Disconnect from the nodes (they keep running, ready for another head) and free the head's model."""
        if getattr(self, "_stack", None) is not None:
            super().close()
        if hasattr(self, "_transport"):
            self._close_ring()


def _head_memory_plan(layout: ModelLayout, windows: list[LayerRange], n_ctx: int, n_batch: int,
                      n_ubatch: int, budget: int | None) -> tuple[PrefetchPlan, bool]:
    """The head's windows follow the nodes' memory policy: resident when they fit in what this device has left
    after the output layer, else streamed like a node's; repacked only where a node would repack them
    (memory/policy.py, repack_allowed). Returns the plan and whether to repack."""
    from primaplug.profiler import compute_buffer_output_bytes

    view = memory_view()
    reserved = reserved_bytes(layout, windows, n_ctx, n_batch, n_ubatch) + \
        compute_buffer_output_bytes(layout, n_ctx, n_batch, n_ubatch)
    if budget is None:
        budget = weights_budget(view, reserved + layout.output_bytes)
    plan = plan_prefetch([layout.window_ranges(r) for r in windows], budget)
    if plan.mode == "stream":
        log.warning("the head's windows do not fit in its memory: %s", plan.describe())
    return plan, repack_allowed(plan, reserved, view.total_bytes)


class _StreamedWindow:
    """A head window whose weights are streamed: tells the prefetcher when it starts and when it is done."""

    def __init__(self, window: Window, prefetcher: Prefetcher, index: int, last: bool) -> None:
        self.window, self.prefetcher, self.index, self.last = window, prefetcher, index, last
        self.layers, self.n_embd = window.layers, window.n_embd

    @property
    def takes_tokens(self) -> bool:
        return self.window.takes_tokens

    def forward(self, inputs: Any, positions: int, *, seq_id: int = 0) -> Any:
        self.prefetcher.window_started(self.index)
        try:
            return self.window.forward(inputs, positions, seq_id=seq_id)
        finally:
            self.prefetcher.window_done(self.index, last_of_token=self.last)

    def kv_clear(self) -> None:
        self.window.kv_clear()

    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        self.window.kv_remove(seq_id, p0, p1)
