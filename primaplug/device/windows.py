"""A device's windows, one per round of the ring, with the prefetch hooks round each computation."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from primaplug.core.windows import LayerRange
from primaplug.device.memory import MemoryPlan, MemorySettings, cpu_parts, plan_memory
from primaplug.engine import ModelLayout
from primaplug.memory.experts import ExpertCache, load_routers
from primaplug.memory.prefetcher import Prefetcher

if TYPE_CHECKING:  # the engine's native library loads when windows do (load()), not when the head is imported
    from primaplug.engine import ContextSettings, Model, Window
    from primaplug.engine.repacked import RepackedForms

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]  # (fraction done, what the device is doing)


class PrefetchHooks:
    """Where each round's window sits in the device's prefetch plan, and the events that drive the plan.

    A device whose windows fit, or that streams whole windows, has one unit per window: prefetched before it runs,
    released after. Layer by layer (where whole windows would fault in, or --layer-streaming on) a streaming device
    has one unit per layer, the window telling which layer it computes (engine/progress.py), so that each layer's
    streamed weights go as soon as it is done and the next layer's come in while it computes. Memory then never
    holds more than the plan says, which lets the kept part of every layer stay resident; streaming whole windows
    could keep nothing of a window larger than the budget (the kernel evicted kept pages along with the streamed
    ones, docs/memory.md).
    """

    def __init__(self, cpu_ranges: Sequence[LayerRange], *, per_layer: bool) -> None:
        """`cpu_ranges`: each round's CPU part of its window (device/memory.py: cpu_parts), the layers the plan
        holds; a window's GPU layers before them are in VRAM and have no unit."""
        self.per_layer = per_layer
        self.cpu_ranges = list(cpu_ranges)
        self.first: dict[int, int] = {}  # round -> index of its window's first unit
        self.prefetcher: Prefetcher | None = None
        self.experts: ExpertCache | None = None  # a streaming mixture of experts' routed experts
        self._current: int | None = None
        n = 0
        for r, part in enumerate(self.cpu_ranges):
            if part.n_layers:
                self.first[r] = n
                n += part.n_layers if per_layer else 1

    def on_layer(self, round_: int) -> Callable[[int], None] | None:
        """The round's window's on_layer callback (layer by layer only)."""
        part = self.cpu_ranges[round_]
        if not self.per_layer or not part.n_layers:
            return None
        first = self.first[round_]
        return lambda il: self._layer(first + il - part.start) if il in part else None

    def started(self, round_: int) -> None:
        """The round's window is about to compute (whole windows; layer by layer, the window says when)."""
        if self.prefetcher is not None and not self.per_layer and round_ in self.first:
            self.prefetcher.window_started(self.first[round_])

    def _layer(self, unit: int) -> None:  # from the computing thread
        p = self.prefetcher
        if p is None or unit == self._current:
            return
        if self._current is not None:
            p.window_done(self._current, last_of_token=False)
        p.window_started(unit)  # asks for the next layer's prefetch
        self._current = unit

    def done(self, round_: int) -> None:
        """The round's output has gone on: its last unit is done."""
        p = self.prefetcher
        if p is None or round_ not in self.first:
            return
        last_round = round_ == max(self.first)
        if last_round and self.experts is not None:
            self.experts.token_done()
        if not self.per_layer:
            p.window_done(self.first[round_], last_of_token=last_round)
        elif self._current is not None:
            p.window_done(self._current, last_of_token=last_round)
            self._current = None


class DeviceWindows:
    """A device's windows of one model, one per round (None in a round where the device runs no layer), on one
    mapping of the file, with their memory plan and prefetcher. Nodes and the head both run their layers here."""

    def __init__(self, model: Model, windows: list[Window | None], plan: MemoryPlan, hooks: PrefetchHooks,
                 prefetcher: Prefetcher | None, experts: ExpertCache | None = None) -> None:
        self.model, self.windows, self.plan, self.hooks = model, windows, plan, hooks
        self.prefetcher, self.experts = prefetcher, experts

    @classmethod
    def load(cls, path: str | os.PathLike[str], layout: ModelLayout, ranges: Sequence[LayerRange], *,
             context: ContextSettings, memory: MemorySettings | None = None, output: bool = False,
             gpu_layers: Sequence[int] = (), extra_reserved: int = 0, extra_weights: int = 0,
             progress: Progress = lambda _f, _w: None, repack_in: RepackedForms | None = None) -> DeviceWindows:
        """Plan memory for the windows of `ranges` (one per round; empty ones relay), map the model and open them.
        `output`: this device also runs the output layer (the head). `repack_in`: the record of a file the caller
        owns, whose CPU layers are repacked in place (engine/model.py)."""
        from primaplug.engine import Model
        from primaplug.engine.progress import ROUTES_READABLE
        from primaplug.engine.repacked import CHUNK_BYTES
        from primaplug.memory.system import memory_view

        ranges, memory = list(ranges), memory or MemorySettings()
        if layout.n_expert and memory.switches.experts and not ROUTES_READABLE:
            log.warning("this engine's ggml_tensor is not the layout primaplug reads the routers' choices from: a "
                        "mixture of experts that streams reads whole layers (rebuild the engine: `primaplug engine "
                        "build`)")
            memory = dataclasses.replace(memory, switches=dataclasses.replace(memory.switches, experts=False))
        used = [r for r in ranges if r.n_layers]
        on_cpu = cpu_parts(ranges, gpu_layers)  # GPU layers' weights and KV cache are in VRAM: not planned for
        # what llama.cpp copies out of the mapping at load, as plain llama.cpp does (a tied lm_head, repacked)
        extra_reserved += layout.output_copy_bytes if output else 0
        plan = plan_memory(layout, [r for r in on_cpu if r.n_layers], n_ctx=context.n_ctx, n_batch=context.n_batch,
                           n_ubatch=context.n_ubatch, memory=memory, extra_reserved=extra_reserved,
                           extra_weights=extra_weights, n_rs_seq=context.n_rs_seq)
        names = ", ".join(map(str, used)) or "(relay only)"
        progress(0.05, f"mapping {os.path.basename(os.path.realpath(path))} for windows {names}; {plan.describe()}")
        if plan.prefetch.mode == "stream":
            log.info("windows %s do not fit in memory: %s", names, plan.describe())
        # writing the repacked copy (once) loads layers with llama.cpp's repacking on: half the budget at a time
        chunk = min(CHUNK_BYTES, max(0, plan.prefetch.budget_bytes) // 2)
        # only the head (the device with the output layer) tokenizes: a node keeps the vocabulary's size alone
        model = Model(path, used, output=output, gpu_layers=gpu_layers, layout=layout, copy_chunk_bytes=chunk,
                      copy_room=lambda: memory_view().available_bytes,
                      progress=lambda f, what: progress(0.05 + 0.05 * f, what), repack_in=repack_in, vocab=output)
        log.info("windows %s: %s", names, model.describe_kernels())
        hooks = PrefetchHooks(on_cpu, per_layer=plan.per_layer)
        experts = None
        try:
            if used:
                shared = len(used) > 1 and model.can_share_context
                progress(0.1, f"creating windows {names}{' on one shared context' if shared else ''}")
            if plan.experts is not None:
                e = plan.experts
                experts = ExpertCache(model.source, e.slices, e.n_expert, e.budget_bytes, n_used=e.n_used,
                                      routers=load_routers(sorted(e.slices), layout.read_tensor,
                                                           gating=layout.expert_gating, groups=layout.expert_groups,
                                                           groups_used=layout.expert_groups_used))
            windows = model.round_windows(ranges, settings=context,
                                          on_layer=[hooks.on_layer(i) for i in range(len(ranges))],
                                          on_route=experts.on_route if experts is not None else None)
            model.pause_threads()  # asleep until work comes (awake())
            prefetcher = Prefetcher(model.source, plan.prefetch, memory.switches) if used else None
            if prefetcher is not None:
                # what the first request needs is read in before the load counts as done, as plain llama.cpp maps
                # its file with MAP_POPULATE: windows that fit, or a streaming device's kept part of every layer and
                # its first window (what the token before would have read ahead). The first request would otherwise
                # wait on that reading: on the emulated desktop of benchmarks/peers.py, W3's 136 MB at 500 MB/s
                # was a third of a second of its TTFT, W2's kept 699 MiB at 125 MB/s most of its 9.9 s
                progress(0.5, f"reading windows {names} into memory" if plan.prefetch.mode == "resident" else
                         f"reading the kept part of windows {names} and the first window's streamed part")
                prefetcher.wait_idle()
        except BaseException:
            if experts is not None:
                experts.close()
            model.close()
            raise
        hooks.prefetcher, hooks.experts = prefetcher, experts
        return cls(model, windows, plan, hooks, prefetcher, experts)

    @property
    def memory_mode(self) -> str:
        """How the device's windows come into memory, for its status."""
        mode = self.prefetcher.mode if self.prefetcher is not None else "relay (no layers)"
        if self.plan.per_layer:
            mode = f"layer by layer, {mode}"
        if self.experts is None:
            return mode
        return f"routed experts read as tokens choose them, the rest of each layer {mode}"

    @property
    def budget_bytes(self) -> int:
        """What the windows' weights may use (with experts read as chosen, their hot set's included)."""
        return self.plan.experts.total_bytes if self.plan.experts else self.plan.prefetch.budget_bytes

    def window(self, round_: int) -> Window | None:
        return self.windows[round_] if round_ < len(self.windows) else None

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """The compute threads woken now, ahead of the work (their wake-up overlaps what the caller does before it),
        and put to sleep after: the next device computes then, and must not find its cores spinning."""
        self.model.resume_threads()
        try:
            yield
        finally:
            self.model.pause_threads()

    def compute(self, round_: int, inputs: np.ndarray, positions: int | np.ndarray, *,
                seq_id: int | np.ndarray = 0) -> np.ndarray:
        """Run round `round_`'s window (which must exist) over token ids or hidden rows: at positions from the
        first one on, or one per row, with one sequence id for all rows or one per row. Call done() once its
        output has gone on."""
        window = self.windows[round_]
        assert window is not None, f"round {round_} has no window on this device"
        self.hooks.started(round_)
        return window.forward(inputs, positions, seq_id=seq_id)

    def done(self, round_: int) -> None:
        self.hooks.done(round_)

    def _contexts(self) -> list[Window]:
        """One window per llama.cpp context: windows on a shared context share its KV cache."""
        from primaplug.engine import one_per_context

        return one_per_context(self.windows)

    def warm_up(self) -> None:
        """One row through each window, then an empty cache, as llama.cpp's tools do after loading ("warming up the
        model with an empty run"): what a first request would otherwise pay for (the compute buffers' and the
        cache's first pages, the threads' first wake-up) is paid at load. Only windows kept resident, which load has
        read in: a streaming device's first pass would read what its prefetcher plans, and a mixture of experts'
        routed experts are read as tokens choose them."""
        if self.prefetcher is None or self.plan.prefetch.mode != "resident" or self.experts is not None:
            return
        with self.awake():
            for i, w in enumerate(self.windows):
                if w is not None:
                    self.compute(i, [0] if w.takes_tokens else np.zeros((1, w.in_width), np.float32), 0)
                    self.done(i)
        self.kv_clear()

    def kv_clear(self) -> None:
        for w in self._contexts():
            w.kv_clear()

    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        for w in self._contexts():
            w.kv_remove(seq_id, p0, p1)

    def kv_pos_max(self, seq_id: int = 0) -> int:
        """The last position the device's caches hold (-1: none)."""
        return max((w.kv_pos_max(seq_id) for w in self._contexts()), default=-1)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        self.model.close()
        if self.experts is not None:  # after the model: no window computes any more
            self.experts.close()
            self.experts = None

