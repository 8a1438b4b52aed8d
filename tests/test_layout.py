"""ModelLayout reads the same tensor table as the gguf package, and sizes windows and the KV cache."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType

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


def test_hybrid_and_gemma4_layouts(model_dir) -> None:
    """Qwen 3.5's recurrent layers hold one state a sequence, no keys or values, and take M-RoPE's four positions a
    row; Gemma 4's sliding layers have narrower heads than its global ones, whose keys are also their values."""
    from primaplug.engine.synthetic import _DELTA_CONV, _DELTA_HEAD, _DELTA_K_HEADS, _DELTA_V_HEADS

    q = read_layout(synthetic_path(model_dir, "qwen35", 7, "Q8_0"))
    assert q.recurrent_layers == (True, True, False, True, True, False, True) and q.has_recurrent_layers
    assert q.positions_per_row == 4 and q.kv_bytes_per_token(0) == 0 and q.kv_bytes_per_token(2) > 0
    value = _DELTA_V_HEADS * _DELTA_HEAD
    state = 4 * ((_DELTA_CONV - 1) * (value + 2 * _DELTA_K_HEADS * _DELTA_HEAD) + _DELTA_HEAD * value)
    assert q.recurrent_state_bytes == state and q.cache_bytes(0, 100, n_seq=2) == 2 * state
    assert q.cache_bytes(2, 100) == 100 * q.kv_bytes_per_token(2)
    nxt = read_layout(synthetic_path(model_dir, "qwen3next", 7, "Q4_K_M"))  # the same layers with plain rope
    assert nxt.recurrent_layers == q.recurrent_layers and nxt.positions_per_row == 1 and nxt.supports_windows
    g = read_layout(synthetic_path(model_dir, "gemma4", 7, "Q4_K_M"))
    assert g.swa_layers == (True, True, False, True, True, False, True) and not g.has_recurrent_layers
    assert g.head_dims(0) == (64, 64) and g.head_dims(2) == (128, 128)
    assert g.kv_bytes_per_token(0) == 2 * 128 * 2 and g.kv_bytes_per_token(2) == 1 * 256 * 2
    assert g.supports_windows and g.positions_per_row == 1
    lfm2 = read_layout(synthetic_path(model_dir, "lfm2", 7, "Q8_0"))  # convolutions: the layers with no KV head
    assert lfm2.recurrent_layers == tuple((il + 1) % 3 != 0 for il in range(7)) and lfm2.has_recurrent_layers
    assert lfm2.recurrent_state_bytes == 4 * 256 * 2 and lfm2.positions_per_row == 1
    moe = read_layout(synthetic_path(model_dir, "lfm2moe", 7, "Q4_K_M"))  # LFM2's layers, experts after the first
    assert moe.recurrent_layers == lfm2.recurrent_layers and moe.recurrent_state_bytes == lfm2.recurrent_state_bytes
    assert moe.expert_slices(0) == () and moe.expert_slices(1) and moe.expert_gating == "sigmoid"
    assert [t.name for t in lfm2.output_tensors] == ["token_embd_norm.weight", "token_embd.weight"]
    llama4 = read_layout(synthetic_path(model_dir, "llama4", 7, "Q4_K_M"))  # chunks of 8192, three of four layers
    assert llama4.sliding_window == 8192 and llama4.swa_layers == (True, True, True, False, True, True, True)
    assert [bool(llama4.expert_slices(il)) for il in range(7)] == [il % 2 == 1 for il in range(7)]


def test_gemma4_per_layer_inputs_and_shared_kv_shape_rows_and_windows(tmp_path) -> None:
    """Gemma 4 E2B/E4B: a row entering layer il carries n_embd values, then the per-layer inputs of the layers from
    il on; a layer with shared KV reads the last layer of its kind before the shared ones, which its window must
    hold; the head, not the node holding layer 0, reads the per-layer embeddings."""
    import pytest

    from primaplug.core import LayerRange, WindowRangeError
    from primaplug.engine.layout import INPUT, unit_tensors, units_for

    layout = _header_only(tmp_path / "gemma4-e2b-like.gguf", "gemma4", {
        "block_count": 6, "embedding_length": 8, "attention.head_count": 1, "embedding_length_per_layer_input": 4,
        "attention.shared_kv_layers": 2, "attention.sliding_window": 32,
        "attention.sliding_window_pattern": [True, True, True, False, True, False]},
        {"token_embd.weight": (4, 8), "per_layer_token_embd.weight": (4, 24), "per_layer_model_proj.weight": (24, 8)})
    assert layout.supports_windows and layout.input_window
    assert [layout.row_width(il) for il in (0, 2, 6)] == [8 + 24, 8 + 16, 8]
    assert [layout.kv_source(il) for il in range(6)] == [None] * 4 + [2, 3]  # sliding reads 2, global 3
    assert layout.kv_bytes_per_token(4) == layout.kv_bytes_per_token(5) == 0 < layout.kv_bytes_per_token(3)
    layout.check_windows([LayerRange(0, 2), LayerRange(2, 6)])
    with pytest.raises(WindowRangeError, match="layer 4, which reads the keys and values of layer 2.*before layer 3"):
        layout.check_windows([LayerRange(0, 3), LayerRange(3, 6)])
    assert INPUT not in units_for(layout, [0, 1], [], output=False)  # its rows come from the head
    assert INPUT in units_for(layout, [4, 5], [], output=True)
    assert {t.name for t in unit_tensors(layout, INPUT)} == {"token_embd.weight", "per_layer_token_embd.weight",
                                                             "per_layer_model_proj.weight"}


def test_latent_attention_caches_keys_only_and_routes_within_groups(model_dir) -> None:
    """DeepSeek's latent attention caches one head of the compressed vector and its rotated part (the values are a
    view of it, llama.cpp allocates none); V3 routes by sigmoid within groups, V2-Lite by softmax over all."""
    v3 = read_layout(synthetic_path(model_dir, "deepseek2", 7, "Q4_K_M"))
    assert v3.keys_only_cache and v3.n_head_kv == (1,) * 7 and v3.head_dims(0) == (128 + 32, 128)
    assert v3.kv_bytes_per_token(0) == (128 + 32) * 2 and v3.supports_windows
    assert (v3.expert_gating, v3.expert_groups, v3.expert_groups_used) == ("sigmoid", 4, 2)
    assert v3.expert_slices(0) == () and len(v3.expert_slices(1)) == 3  # a dense first layer; shared experts apart
    lite = read_layout(synthetic_path(model_dir, "deepseek2-lite", 7, "Q8_0"))
    assert lite.keys_only_cache and lite.tensor("blk.0.attn_q.weight") is not None
    assert (lite.expert_gating, lite.expert_groups) == ("softmax", 0)


def test_glm5_windows_start_at_any_layer_with_its_own_indexer(tmp_path) -> None:
    """GLM 5 and 5.1 (an indexer in every layer: the file says so, or its context is under 1M tokens) start windows
    anywhere; GLM 5.2's shared-indexer layers attend to the keys an earlier layer chose, and start none."""
    from gguf import GGUFWriter

    def layout(**keys: object):  # noqa: ANN202
        path = tmp_path / f"glm-{len(list(tmp_path.iterdir()))}.gguf"
        w = GGUFWriter(str(path), "glm-dsa")
        w.add_block_count(4)
        w.add_embedding_length(64)
        w.add_head_count(4)
        for key, value in keys.items():
            w.add_key_value(f"glm-dsa.{key}", value, GGUFValueType.ARRAY if isinstance(value, list) else
                            GGUFValueType.UINT32, sub_type=GGUFValueType.UINT32 if isinstance(value, list) else None)
        w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return read_layout(path)

    assert layout(context_length=202752).barred_starts == ()
    assert layout(**{"attention.indexer.types": [1, 1, 1, 1]}).barred_starts == ()
    shared = layout(**{"attention.indexer.types": [1, 1, 0, 0]})
    assert shared.supports_windows and shared.barred_starts == (2, 3)
    assert layout(context_length=1048576).barred_starts == (3,)  # GLM 5.2's own pattern, where the file says none


def test_glm_5_2_windows_start_at_layers_with_their_own_indexer(tmp_path) -> None:
    """GLM 5.2 without `indexer.types` (llama.cpp's default for a context of 1M tokens): an indexer of their own in
    layers 0, 1 and every fourth from 2; a window starts at one of them, and an even split's boundaries move down to
    one."""
    import pytest

    from primaplug.core import LayerRange, WindowRangeError

    layout = _header_only(tmp_path / "glm-5.2-like.gguf", "glm-dsa", {
        "block_count": 12, "embedding_length": 8, "attention.head_count": 1, "context_length": 1048576},
        {"token_embd.weight": (4, 8)})
    assert layout.supports_windows and layout.barred_starts == (3, 4, 5, 7, 8, 9, 11)
    assert layout.snap_sizes([4, 4, 4]) == [2, 4, 6] and layout.snap_sizes([6, 6]) == [6, 6]
    layout.check_windows([LayerRange(0, 2), LayerRange(2, 6), LayerRange(6, 12)])
    with pytest.raises(WindowRangeError, match=r"starts at layer 4, which attends to the keys the indexer of layer 2 "
                                               r"chose.*\(not 3-5, 7-9, 11\)"):
        layout.check_windows([LayerRange(0, 4), LayerRange(4, 12)])


def _header_only(path, arch: str, keys: dict, tensors: dict):  # noqa: ANN001, ANN202
    """A GGUF of `arch` with these metadata keys (integers, or arrays) and zero tensors of these shapes, read back."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        w.add_array(f"{arch}.{key}", value) if isinstance(value, list) else w.add_uint32(f"{arch}.{key}", value)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_layout(path)


def test_long_arrays_are_stepped_over_unread_and_a_cut_one_is_named() -> None:
    """A vocabulary (strings), scores (floats) and an array of arrays longer than the parser decodes give their
    length, and what follows them is read right; a header cut inside one is refused as truncated."""
    import struct

    import pytest

    from primaplug.core import ModelFormatError
    from primaplug.engine.layout import _MAX_DECODED_ARRAY, _Cursor

    n = _MAX_DECODED_ARRAY + 5
    words = [f"tok{i}" + "x" * (i % 13) for i in range(n)]
    strings = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, n) + b"".join(
        struct.pack("<Q", len(w)) + w.encode() for w in words)
    floats = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.FLOAT32, n) + struct.pack(f"<{n}f", *range(n))
    pair = struct.pack("<IQ", GGUFValueType.INT32, 2) + struct.pack("<2i", 1, 2)
    nested = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.ARRAY, n) + pair * n
    after = struct.pack("<II", GGUFValueType.UINT32, 7)
    short = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, 2) + b"".join(
        struct.pack("<Q", len(w)) + w.encode() for w in ("a", "bc"))
    buf = strings + floats + nested + short + after
    cur = _Cursor(buf, "model.gguf")
    values = [cur.value(int(cur.unpack("<I"))) for _ in range(5)]
    assert values == [n, n, n, ["a", "bc"], 7] and cur.pos == len(buf)
    cur = _Cursor(strings[: len(strings) // 2], "model.gguf")
    with pytest.raises(ModelFormatError, match="truncated"):
        cur.value(int(cur.unpack("<I")))
