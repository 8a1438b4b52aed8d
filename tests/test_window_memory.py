"""A window touches only its own layers' weights and keeps only its own layers' KV cache."""

from __future__ import annotations

import os

import numpy as np

from primaplug.core import LayerRange
from primaplug.engine import ContextSettings, Model, read_layout
from primaplug.memory import drop_file_cache, resident_bytes
from tests.conftest import synthetic_path

SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32)


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


def test_kv_cache_holds_only_the_window_layers(model_dir) -> None:
    path = synthetic_path(model_dir, "llama", 9, "Q8_0")
    layout = read_layout(path)
    n_tokens = 50
    prompt = np.random.default_rng(1).integers(3, layout.n_vocab, size=n_tokens)
    windows = [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 9)]
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
