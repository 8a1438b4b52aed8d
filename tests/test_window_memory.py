"""A window touches only its own layers' weights and keeps only its own layers' KV cache."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

from primaplug.core import LayerRange
from primaplug.core.errors import EngineError
from primaplug.engine import ContextSettings, Model, read_layout
from primaplug.memory import drop_file_cache, resident_bytes
from primaplug.profiler.model import compute_buffer_layers_bytes
from tests.conftest import synthetic_path
from tests.ring_helpers import THREADS

SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS)
T = TypeVar("T")


def test_middle_window_leaves_lm_head_on_disk(gemma_path, tmp_path) -> None:
    # a private copy, so that no other test's mapping of the bundled file keeps its pages cached
    path = tmp_path / "gemma.gguf"
    with open(path, "wb") as f:
        f.write(gemma_path.read_bytes())
        os.fsync(f.fileno())  # dirty pages cannot be dropped from the page cache
    layout = read_layout(path)
    assert layout.output_tied  # Gemma's lm_head is its 178 MB token embedding
    window = LayerRange(6, 12)
    drop_file_cache(path)

    with Model(path, [window], output=False) as model:
        w = model.window(window.start, window.end, settings=SETTINGS)
        # loading mapped the file without reading it: no MAP_POPULATE, no WILLNEED over the whole file
        # (what is resident is the header and the kernel's readahead around it: read_ahead_kb can be 8 MiB)
        assert resident_bytes(path, [(0, layout.file_size)]) < 0.3 * layout.file_size
        # reading the header read ahead a little into the tensor data: drop the lm_head's range again
        drop_file_cache(path, layout.output_ranges())
        assert resident_bytes(path, layout.output_ranges()) == 0

        hidden = np.random.default_rng(0).standard_normal((40, layout.n_embd)).astype(np.float32)
        for pos in (0, 40):
            assert w.forward(hidden, pos).shape == (40, layout.n_embd)
        # the window read its own weights, and not one page of the lm_head
        assert resident_bytes(path, layout.window_ranges(window)) > 0
        assert resident_bytes(path, layout.output_ranges()) == 0


@pytest.mark.parametrize(("arch", "n_layer", "ftype"), [("llama", 9, "Q8_0"), ("deepseek2", 7, "Q4_K_M"),
                                                        ("deepseek32", 7, "Q4_K_M")])
def test_kv_cache_holds_only_the_window_layers(model_dir, arch: str, n_layer: int, ftype: str) -> None:
    """What a window's cache holds, as llama.cpp saves it, is what the layout (and so every budget and Halda) counts:
    grouped-query keys and values; latent attention's keys only (the compressed vector, read as the values too)."""
    path = synthetic_path(model_dir, arch, n_layer, ftype)
    layout = read_layout(path)
    assert layout.keys_only_cache == arch.startswith("deepseek")
    n_tokens = 50
    prompt = np.random.default_rng(1).integers(3, layout.n_vocab, size=n_tokens)
    windows = [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, n_layer)]
    with Model(path, windows) as model:
        hidden = None
        sizes = {}
        for rng in windows:
            w = model.window(rng.start, rng.end, output_hidden=True, settings=SETTINGS)
            hidden = w.forward(prompt if hidden is None else hidden, 0)
            sizes[rng] = w.state_bytes(0)
    # size = fixed header + layers x (tokens x KV bytes per token and layer + a small per-layer record)
    (a, sa), (b, sb), (c, sc) = ((r.n_layers, sizes[r]) for r in windows)
    per_layer = (sc - sb) // (c - b)
    assert (sc - sb) == per_layer * (c - b) and (sb - sa) == per_layer * (b - a), sizes
    overhead = per_layer - n_tokens * layout.kv_bytes_per_token(0)
    assert 0 <= overhead < 64, f"per-layer state {per_layer} B is not {n_tokens} tokens x KV bytes per token"
    assert 0 <= sa - per_layer * a < per_layer


def test_gemma4_shared_kv_layers_cache_nothing(model_dir) -> None:
    """Gemma 4 E2B/E4B: a sliding layer caches its narrower heads, a global one its wider single head, and a layer that
    reads an earlier layer's keys and values caches none, as the layout counts them (ModelLayout.kv_bytes_per_token),
    in each window's state as llama.cpp saves it: three windows give a header and a per-layer record that fit all."""
    path = synthetic_path(model_dir, "gemma4-e2b", 7, "Q4_K_M")
    layout = read_layout(path)
    kv = [layout.kv_bytes_per_token(il) for il in range(7)]
    assert kv[6] == 0 < kv[2] and kv[0] > 0  # layer 6 reads layer 4's; layer 2 is global, 0 sliding
    n_tokens = 30  # within the sliding window (32): the sliding layers' caches keep every token too
    prompt = np.random.default_rng(1).integers(3, layout.n_vocab, size=n_tokens)
    windows = [LayerRange(0, 1), LayerRange(1, 4), LayerRange(4, 7)]
    with Model(path, windows) as model:
        hidden = model.window(0, 0, output_hidden=True, settings=SETTINGS).forward(prompt, 0)  # the input window
        sizes = []
        for rng in windows:
            w = model.window(rng.start, rng.end, output_hidden=True, settings=SETTINGS)
            hidden = w.forward(hidden, 0)
            sizes.append(w.state_bytes(0))
    held = [sum(n_tokens * kv[il] for il in range(r.start, r.end)) for r in windows]
    records = [sum(1 for il in range(r.start, r.end) if kv[il]) for r in windows]  # layers with a cache of their own
    record = (sizes[1] - held[1] - sizes[0] + held[0]) // (records[1] - records[0])
    header = sizes[0] - held[0] - record * records[0]
    assert 0 <= record < 64 and header >= 0, (sizes, held)
    assert sizes[2] == header + held[2] + record * records[2], (sizes, held)  # layer 6 adds nothing


def _anon_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _run_windows(path: str, windows: list[LayerRange], settings: ContextSettings, steps: int,
                 prompt: list[int], shared: bool = False, count_creation: bool = False) -> tuple[list[int], int, int]:
    """In a fresh process: greedy tokens through the chained windows (the last outputs logits; with shared, the
    others share one context), the growth of anonymous memory from before the first forward (or, count_creation,
    from before the windows are created) to the end, and the compute bytes the windows gave back."""
    with Model(path, windows) as model:
        before = _anon_bytes()
        if shared:
            ws = [*model.shared_windows(windows[:-1], settings=settings),
                  model.window(windows[-1].start, windows[-1].end, settings=settings)]
        else:
            ws = [model.window(r.start, r.end, settings=settings) for r in windows]
        if not count_creation:
            before = _anon_bytes()
        tokens: list[int] = []
        feed, pos = np.asarray(prompt), 0
        for _ in range(steps):
            x = feed
            for w in ws:
                x = w.forward(x, pos)
            pos += len(feed)
            tokens.append(int(np.argmax(x[-1])))
            feed = np.array(tokens[-1:])
        return tokens, _anon_bytes() - before, sum(w.compute_released_bytes for w in ws)


def _fresh(fn: Callable[..., T], *args: object) -> T:
    # a fresh interpreter each time, so that memory one run freed cannot hide what the next one takes
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _in_fresh_process(*args: object) -> tuple[list[int], int, int]:
    return _fresh(_run_windows, *args)


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")


@linux_only
def test_windows_give_their_compute_buffers_back_after_a_prompt(model_dir) -> None:
    """Each window's compute buffer is sized for a full micro-batch; after a prompt its pages go back to the OS, so
    a process running several windows one after another keeps one buffer's worth at most, and decoding (one row)
    touches only a small part again. The tokens do not change."""
    path = synthetic_path(model_dir, "llama", 9, "Q8_0")
    layout = read_layout(path)
    windows = [LayerRange(il, il + 1) for il in range(8)] + [LayerRange(8, 9)]
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, layout.n_vocab, size=128)]
    big = ContextSettings(n_ctx=256, n_batch=128, n_ubatch=128)  # a compute buffer of about 1.5 MiB per window
    tokens, growth, released = _in_fresh_process(str(path), windows, big, 4, prompt)
    kept_tokens, kept_growth, kept_released = _in_fresh_process(
        str(path), windows, dataclasses.replace(big, release_compute=False), 4, prompt)
    assert tokens == kept_tokens
    assert kept_released == 0 and released > 0
    per_window = compute_buffer_layers_bytes(layout, 256, 128, 128)
    # nine prompt-sized buffers stay resident without the release; with it, at most about one
    assert kept_growth - growth > 6 * per_window, (kept_growth, growth, per_window)


def _load_growth(path: str, vocab: bool) -> tuple[int, int, list[float]]:
    """In a fresh process: the anonymous memory a load for windows 0-9 takes, the vocabulary's size as llama.cpp
    counts it, and the hidden rows the window computes."""
    from llama_cpp import llama_cpp as ll

    before = _anon_bytes()
    with Model(path, [(0, 9)], output=False, vocab=vocab) as model:
        growth = _anon_bytes() - before
        n_tokens = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model._ptr))
        rows = model.window(0, 9, settings=ContextSettings(n_ctx=64, n_batch=16, n_ubatch=16, n_threads=THREADS))
        return growth, n_tokens, rows.forward([2, 105, 2364, 107], 0).ravel().tolist()


@linux_only
def test_windows_that_never_tokenize_keep_the_vocabularys_size_only(gemma_path) -> None:
    """A node runs layers on hidden states and never tokenizes: its windows keep the vocabulary's size (the token
    embedding and output shapes need it), not Gemma 3's 262,144 tokens, which held about 40 MiB and took half a
    second to load. The rows are the same; asked to tokenize, such a model says why it cannot."""
    full, lean = _fresh(_load_growth, str(gemma_path), True), _fresh(_load_growth, str(gemma_path), False)
    layout = read_layout(gemma_path)
    assert full[1] == lean[1] == layout.n_vocab
    assert lean[2] == full[2]
    assert full[0] - lean[0] > 25 << 20, f"{full[0] / 2**20:.1f} MiB with the tokens, {lean[0] / 2**20:.1f} without"
    with Model(gemma_path, [(0, 1)], output=False, vocab=False) as model, \
            pytest.raises(EngineError, match="never tokenize"):
        model.tokenize("Hello")
    # a device loads the vocabulary only where it runs the output layer: the head, which tokenizes
    from primaplug.device import DeviceWindows

    for output in (False, True):
        device = DeviceWindows.load(gemma_path, layout, [LayerRange(0, 1)], context=SETTINGS, output=output)
        try:
            assert device.model.has_vocab == output
        finally:
            device.close()


@linux_only
def test_a_window_that_outputs_hidden_states_keeps_no_logits(gemma_path) -> None:
    """llama.cpp sizes every context's output buffer for n_vocab logits per output row and clears it; a window
    outputs n_embd floats per row and no logits. On Gemma 3 (262,144 tokens) a 64-row prompt would take 64 MiB
    per window for logits nobody reads."""
    layout = read_layout(gemma_path)
    settings = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=64)
    prompt = list(range(10, 74))
    _, growth, _ = _in_fresh_process(str(gemma_path), [LayerRange(0, 9), LayerRange(9, 18)], settings, 1, prompt)
    logits_rows = 4 * layout.n_vocab * len(prompt)  # 64 MiB: what the hidden window's logits would take
    assert growth < logits_rows / 2, f"{growth / 2**20:.1f} MiB"


def _kv_growth(path: str, settings: ContextSettings, prompt: list[int]) -> tuple[int, int, int]:
    """In a fresh process: anonymous memory a window takes when created, after a prompt, and after a clear."""
    with Model(path, [LayerRange(0, 9)]) as model:
        before = _anon_bytes()
        w = model.window(0, 9, settings=settings)
        created = _anon_bytes() - before
        w.forward(prompt, 0)
        prompted = _anon_bytes() - before
        w.kv_clear()
        return created, prompted, _anon_bytes() - before


@linux_only
def test_a_kv_cache_takes_memory_as_tokens_fill_it(model_dir) -> None:
    """llama.cpp wrote zeros over the whole KV cache when it made and cleared it, so a context for 4096 tokens took
    all of its memory at once; the cache's pages are given back instead (patch 0007) and come back as tokens are
    written. The values (V) are stored transposed, so the first token touches all of them; the keys, half, only as
    they fill."""
    path = synthetic_path(model_dir, "llama", 9, "Q8_0")
    layout = read_layout(path)
    settings = ContextSettings(n_ctx=4096, n_batch=64, n_ubatch=64)
    kv = sum(layout.kv_bytes_per_token(il) for il in range(9)) * settings.n_ctx
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        created, prompted, cleared = pool.submit(_kv_growth, str(path), settings, list(range(10, 74))).result()
    assert created < kv / 4, (created, kv)
    assert prompted < created + kv * 3 / 4, (prompted, kv)  # the values, and 64 of the 4096 keys
    assert prompted - cleared > kv / 4, (prompted, cleared, kv)  # a clear gives the cache back


def test_a_node_gives_a_batchs_freed_memory_back_once_its_output_is_sent(monkeypatch) -> None:
    # glibc keeps what a prompt's batch freed in its arenas; the node hands it back after the batch, not per token
    import types

    from primaplug.node import deployment
    from primaplug.wire import PROTOCOL_VERSION, Activation, Part

    trims: list[int] = []
    released: list[int] = []
    monkeypatch.setattr(deployment, "return_freed_memory", lambda: trims.append(1))
    node = deployment.Deployment(assignment=None, device=types.SimpleNamespace(done=released.append),  # type: ignore[arg-type]
                                 out=None, n_layer=18)  # type: ignore[arg-type]

    def sent(n_rows: int, round_: int) -> None:
        node.sent(Activation(proto=PROTOCOL_VERSION, epoch=1, step=1, round=round_, parts=(Part(0, 0, n_rows),),
                             width=8, dtype="float32"))

    sent(1, 0)
    assert released == [0] and trims == []
    sent(16, 1)
    assert released == [0, 1] and trims == [1]


def test_windows_that_fit_are_read_in_and_warmed_up_before_the_load_returns(model_dir, tmp_path) -> None:
    """As plain llama.cpp's tools do at load (MAP_POPULATE, then "warming up the model with an empty run"), so that
    the first request pays for neither: the windows' weights are resident when the load returns, one row has gone
    through each window, and the cache is empty again (the first request's tokens are those of a device loaded
    without it: tests/test_ring.py)."""
    from primaplug.device import DeviceWindows, MemorySettings

    path = tmp_path / "model.gguf"  # a private copy: no other test's mapping keeps its pages cached
    path.write_bytes(synthetic_path(model_dir, "llama", 9, "Q4_K_M").read_bytes())
    os.sync()
    layout = read_layout(path)
    ranges = [LayerRange(0, 3), LayerRange(5, 9)]
    DeviceWindows.load(path, layout, ranges, context=SETTINGS, memory=MemorySettings()).close()  # the copy, once
    drop_file_cache(path)
    device = DeviceWindows.load(path, layout, ranges, context=SETTINGS, memory=MemorySettings())
    try:
        plan = device.plan.prefetch
        assert plan.mode == "resident" and device.prefetcher is not None
        source = device.prefetcher.path
        device.close()
        drop_file_cache(source)  # what load read in, gone: a device that loads again reads it again
        device = DeviceWindows.load(path, layout, ranges, context=SETTINGS, memory=MemorySettings())
        assert device.prefetcher is not None
        assert device.prefetcher.resident_bytes() >= 0.95 * sum(n for _, n in plan.keep) > 0
        device.warm_up()  # as a node and the head do after loading: the cache is left empty
        for w in device.windows:
            assert w is not None and w.kv_pos_max(0) == -1
    finally:
        device.close()


def test_a_streaming_device_reads_its_kept_part_and_first_window_before_the_load_returns(model_dir, tmp_path) -> None:
    """A device whose windows do not fit keeps part of every layer for good and streams the rest: the kept part and
    the first window's streamed part are read in before the load returns, as for windows that fit, so that the
    first request does not wait on a cold disk (W2 of benchmarks/peers.py: its TTFT was 3x its TPOT)."""
    from primaplug.device import DeviceWindows, MemorySettings

    path = tmp_path / "model.gguf"
    path.write_bytes(synthetic_path(model_dir, "llama", 9, "Q4_K_M").read_bytes())
    os.sync()
    layout = read_layout(path)
    ranges = [LayerRange(0, 3), LayerRange(5, 9)]
    windows_bytes = sum(layout.layer_bytes(il) for r in ranges for il in range(r.start, r.end))
    memory = MemorySettings(budget_bytes=windows_bytes * 4 // 5)  # room to keep part of every layer
    DeviceWindows.load(path, layout, ranges, context=SETTINGS, memory=memory).close()  # the copy, once
    device = DeviceWindows.load(path, layout, ranges, context=SETTINGS, memory=memory)
    try:
        plan = device.plan.prefetch
        assert plan.mode == "stream" and plan.keep and device.prefetcher is not None
        source = device.prefetcher.path
        device.close()
        drop_file_cache(source)  # a cold disk, as after a reboot: everything the load needs is read again
        device = DeviceWindows.load(path, layout, ranges, context=SETTINGS, memory=memory)
        wanted = [*plan.keep, *plan.prefetch_ranges(0)]
        assert resident_bytes(source, wanted) >= 0.95 * sum(n for _, n in wanted) > 0
    finally:
        device.close()
