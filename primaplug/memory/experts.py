"""The routed experts of a mixture of experts, read only when a token routes to them.

A node that streams an MoE window reads the rest of each layer (attention, norms, router, shared experts) as any
window (policy.py, prefetcher.py). The routed experts it leaves to this cache: when a layer's router has chosen
(engine/progress.py: on_route), the chosen experts that are not in memory are read, each as its contiguous slices
of the gate, up and down tensors, in large preads from several threads, while the computation waits for them. The
router's input also predicts the next layer's choice (its router applied to the same hidden state), whose reads
start at once, in the background. Each layer's most used experts (counts that decay every token) stay resident
within the budget; the coldest go when it is exceeded. Outputs never change: this only decides what is in memory
when llama.cpp reads its mapping.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from primaplug.memory.advice import Advisor, read_range

log = logging.getLogger(__name__)

READ_CHUNK = 4 << 20  # bytes a reader asks for at once: an expert's slice of a large model is about 1-4 MiB
READERS = 4  # concurrent reads: a disk serves several requests at once (NVMe queues, and a throttled disk too)
DECAY = 0.9  # per token: an expert's use count loses a tenth each token, so the hot set follows what runs now

Slices = tuple[tuple[int, int], ...]  # (offset, bytes per expert) of each routed expert tensor of a layer


@dataclass(frozen=True)
class Router:
    """What predicts a layer's choice from a hidden state, as llama.cpp's build_moe_ffn chooses: its router matrix
    (n_expert, n_embd), the biases that change which experts are chosen (gpt-oss's logit bias; the selection bias
    that DeepSeek-V3 adds to the gating's output), the gating function, and DeepSeek's expert groups (the experts of
    the best `groups_used` of `groups` groups, a group scored by its two best experts)."""

    weight: np.ndarray
    bias: np.ndarray | None = None
    selection_bias: np.ndarray | None = None  # added after the gating (glm4moe, DeepSeek-V3)
    gating: str = "sigmoid"
    groups: int = 0
    groups_used: int = 0

    def choose(self, x: np.ndarray, k: int) -> np.ndarray:
        """The k experts each row of x (n_tokens, n_embd) would be routed to: (n_tokens, k)."""
        scores = x @ self.weight.T
        if self.bias is not None:
            scores = scores + self.bias
        if self.selection_bias is not None or self.groups > 1:  # else the gating keeps the logits' order
            if self.gating == "softmax":
                scores = np.exp(scores - scores.max(axis=1, keepdims=True))
                scores /= scores.sum(axis=1, keepdims=True)
            elif self.gating == "sigmoid":
                scores = 1.0 / (1.0 + np.exp(-scores))
            if self.selection_bias is not None:
                scores = scores + self.selection_bias
        if self.groups > 1:
            grouped = scores.reshape(len(scores), self.groups, -1)
            best = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)  # (n_tokens, groups)
            keep = np.argpartition(-best, self.groups_used - 1, axis=1)[:, : self.groups_used]
            masked = np.full_like(grouped, -np.inf)
            rows = np.arange(len(scores))[:, None]
            masked[rows, keep] = grouped[rows, keep]
            scores = masked.reshape(len(scores), -1)
        return np.argpartition(-scores, k - 1, axis=1)[:, :k]


@dataclass
class ExpertStats:
    """Counts since the load; `bytes_needed` is what a reader of exactly the chosen experts reads."""

    tokens: int = 0
    needed: int = 0  # (layer, expert) choices, each counted once per computation of a layer
    resident: int = 0  # of those, in memory already (the hot set, or read for an earlier token)
    predicted: int = 0  # of those, read (or being read) because the prediction named them
    bytes_needed: int = 0
    bytes_read: int = 0  # for choices and predictions
    bytes_predicted_unused: int = 0  # predictions read that the layer did not choose
    bytes_released: int = 0


class ExpertCache:
    """The routed experts of a device's layers: `slices` per layer (ModelLayout.expert_slices), read from `path`
    (the file llama.cpp maps) within `budget_bytes`; `routers` per layer for predictions (may be empty)."""

    def __init__(self, path: str, slices: Mapping[int, Slices], n_expert: int, budget_bytes: int, *,
                 routers: Mapping[int, Router] | None = None, n_used: int = 1, readers: int = READERS,
                 advisor: Advisor | None = None) -> None:
        self.path, self.slices, self.n_expert = path, dict(slices), n_expert
        self.budget_bytes, self.routers, self.n_used = budget_bytes, dict(routers or {}), n_used
        self.layers = sorted(self.slices)
        self.expert_bytes = {il: sum(n for _, n in s) for il, s in self.slices.items()}
        self.stats = ExpertStats()
        self._advisor = advisor or Advisor(path)
        self._own_advisor = advisor is None
        self._fd = os.open(path, os.O_RDONLY)
        self._lock = threading.Lock()
        self._resident: set[tuple[int, int]] = set()  # (layer, expert) in memory
        self._reading: dict[tuple[int, int], Future[int]] = {}
        self._predicted: set[tuple[int, int]] = set()
        self._score = {il: np.zeros(n_expert) for il in self.layers}
        self._bytes = 0  # resident and being read
        self._pool = ThreadPoolExecutor(max(1, readers), thread_name_prefix="experts")
        self._local = threading.local()

    # --- from the computing thread ------------------------------------------------------------------------

    def on_route(self, layer: int, chosen: np.ndarray, x: np.ndarray | None) -> None:
        """engine/progress.py's callback: read what layer `layer` chose and is not in memory, waiting for it; then
        start reading the next layer's predicted choice."""
        if layer not in self.slices:
            return
        self.need(layer, np.unique(chosen))
        nxt = self._next_layer(layer)
        if x is not None and nxt is not None and nxt in self.routers:
            self.predict(nxt, np.unique(self.routers[nxt].choose(x, self.n_used)))

    def need(self, layer: int, experts: Sequence[int] | np.ndarray) -> None:
        """The layer chose these experts: read those not in memory (or wait for their reads), then trim."""
        waits = []
        with self._lock:
            n = self.expert_bytes[layer]
            for e in map(int, experts):
                key = (layer, e)
                self.stats.needed += 1
                self.stats.bytes_needed += n
                self._score[layer][e] += 1.0
                if key in self._predicted:
                    self.stats.predicted += 1
                    self._predicted.discard(key)
                elif key in self._resident:
                    self.stats.resident += 1
                if key in self._reading:
                    waits.append(self._reading[key])
                elif key not in self._resident:
                    waits.append(self._start(key))
        for f in waits:
            f.result()
        self._trim(protect={(layer, int(e)) for e in experts})

    def predict(self, layer: int, experts: Sequence[int] | np.ndarray) -> None:
        """Start reading experts the layer will likely choose; never waits."""
        with self._lock:
            for e in map(int, experts):
                key = (layer, e)
                if key not in self._resident and key not in self._reading:
                    self._predicted.add(key)
                    self._start(key)

    def token_done(self) -> None:
        """After each token: counts decay, and predictions the layers did not choose are counted as waste."""
        with self._lock:
            self.stats.tokens += 1
            for il in self.layers:
                self._score[il] *= DECAY
            for il, _ in self._predicted:
                self.stats.bytes_predicted_unused += self.expert_bytes[il]
            self._predicted.clear()

    # --- reading and releasing ----------------------------------------------------------------------------

    def _ranges(self, key: tuple[int, int]) -> list[tuple[int, int]]:
        layer, e = key
        return [(off + e * n, n) for off, n in self.slices[layer]]

    def _start(self, key: tuple[int, int]) -> Future[int]:  # with the lock held
        self._bytes += self.expert_bytes[key[0]]
        future = self._pool.submit(self._fetch, key)
        self._reading[key] = future
        return future

    def _fetch(self, key: tuple[int, int]) -> int:
        """Read an expert, and account for it before its future completes (whoever waits sees it resident)."""
        try:
            n = self._read(self._ranges(key))
        except OSError as e:
            with self._lock:
                self._reading.pop(key, None)
                self._bytes -= self.expert_bytes[key[0]]
                self._predicted.discard(key)
            log.warning("reading expert %d of layer %d failed: %s", key[1], key[0], e)
            raise
        with self._lock:
            self._reading.pop(key, None)
            self.stats.bytes_read += n
            self._resident.add(key)
        return n

    def _read(self, ranges: list[tuple[int, int]]) -> int:
        buf = getattr(self._local, "buf", None)  # one buffer per reader thread
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(READ_CHUNK))
        return sum(read_range(self._fd, buf, off, n) for off, n in ranges)

    def _trim(self, protect: set[tuple[int, int]]) -> None:
        """Release the coldest resident experts until the budget holds (never those just chosen)."""
        drop: list[tuple[int, int]] = []
        with self._lock:
            if self._bytes <= self.budget_bytes:
                return
            cold = sorted((self._score[il][e], (il, e)) for il, e in self._resident
                          if (il, e) not in protect and (il, e) not in self._predicted)
            for _, key in cold:
                if self._bytes <= self.budget_bytes:
                    break
                self._resident.discard(key)
                self._bytes -= self.expert_bytes[key[0]]
                drop.append(key)
        if drop:
            self.stats.bytes_released += self._advisor.release([r for k in drop for r in self._ranges(k)])

    def _next_layer(self, layer: int) -> int | None:
        i = self.layers.index(layer)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    # --- measurements and shutdown ------------------------------------------------------------------------

    def resident_experts(self) -> int:
        with self._lock:
            return len(self._resident)

    def wait_idle(self) -> None:
        with self._lock:
            pending = list(self._reading.values())
        for f in pending:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        os.close(self._fd)
        if self._own_advisor:
            self._advisor.close()


def load_routers(layers: Sequence[int], read: Callable[[str], np.ndarray | None], *, gating: str = "sigmoid",
                 groups: int = 0, groups_used: int = 0) -> dict[int, Router]:
    """Routers of `layers`: `read(name)` gives a tensor as float32 numpy (ggml's dims reversed), or None; the model's
    gating and expert groups (ModelLayout.expert_gating, expert_groups, expert_groups_used)."""
    out = {}
    for il in layers:
        w = read(f"blk.{il}.ffn_gate_inp.weight")
        if w is None:
            continue
        out[il] = Router(w.astype(np.float32), read(f"blk.{il}.ffn_gate_inp.bias"), read(f"blk.{il}.exp_probs_b.bias"),
                         gating=gating, groups=groups, groups_used=groups_used)
    return out
