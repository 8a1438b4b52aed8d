"""ModelLayout reads the same tensor table as the gguf package, and sizes windows and the KV cache."""

from __future__ import annotations

from gguf import GGUFReader

from primaplug.core import LayerRange
from primaplug.engine import read_layout
from tests.conftest import synthetic_path


def test_layout_matches_gguf_reader(model_dir) -> None:
    path = synthetic_path(model_dir, "qwen3", 9, "Q4_K_M")
    layout = read_layout(path)
    reader = GGUFReader(path)
    assert {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors} == {
        t.name: (t.offset, t.nbytes) for t in layout.tensors
    }
    assert (layout.arch, layout.n_layer, layout.n_embd, layout.n_vocab) == ("qwen3", 9, 256, 512)
    assert layout.n_head_kv == (2,) * 9 and layout.head_dim_k == 64
    assert layout.kv_bytes_per_token(0) == 2 * (64 + 64) * 2
    assert not layout.output_tied


def test_bytes_add_up(model_dir) -> None:
    layout = read_layout(synthetic_path(model_dir, "llama", 7, "Q8_0"))
    per_layer = sum(layout.layer_bytes(il) for il in range(layout.n_layer))
    assert per_layer + layout.input_bytes + layout.output_bytes == sum(t.nbytes for t in layout.tensors)
    window = layout.window_ranges(LayerRange(2, 5))
    assert sum(n for _, n in window) == sum(layout.layer_bytes(il) for il in range(2, 5))


def test_gemma_layout(gemma_path) -> None:
    layout = read_layout(gemma_path)
    assert (layout.arch, layout.n_layer, layout.n_embd, layout.n_vocab) == ("gemma3", 18, 640, 262144)
    assert layout.output_tied and layout.sliding_window == 512
    assert layout.swa_layers[:6] == (True,) * 5 + (False,)
    assert layout.identity.startswith(f"{layout.file_size}:")
