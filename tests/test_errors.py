"""Bad input gets a clear error that names the problem."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from primaplug.core import LayerRange, ModelFormatError, UnsupportedArchitectureError, WindowRangeError
from primaplug.engine import SUPPORTED_ARCHS, ContextSettings, Model, _log, _native, read_layout
from tests.conftest import synthetic_path

SETTINGS = ContextSettings(n_ctx=128, n_batch=32, n_ubatch=32)


def test_python_and_native_agree_on_supported_architectures() -> None:
    assert set(_native.supported_archs()) == set(SUPPORTED_ARCHS)


@pytest.mark.parametrize(("arch", "why"), [("gpt2", None), ("deepseek4", "hyper-connections")])
def test_unsupported_architecture_is_named(tmp_path, arch: str, why: str | None) -> None:
    """Refused before anything loads, naming the architecture, why where the engine's llama.cpp runs it but windows
    do not split it yet, and what windows cover."""
    path = tmp_path / f"{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_context_length(128)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError) as e:
        Model(path, [(0, 2)])
    msg = str(e.value)
    assert f"'{arch}'" in msg and all(a in msg for a in SUPPORTED_ARCHS)
    assert (why in msg and "plain llama-cpp-python" in msg) if why else "layer windows;" in msg


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a model at all")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_layout(path)
    with pytest.raises(ModelFormatError, match="cannot open"):
        read_layout(tmp_path / "missing.gguf")


def test_windows_outside_the_model(model_dir) -> None:
    path = synthetic_path(model_dir, "llama", 7, "Q8_0")
    with pytest.raises(WindowRangeError, match=r"outside the model's layers \[0, 7\)"):
        Model(path, [(0, 8)])
    with pytest.raises(WindowRangeError, match="not a layer range"):
        LayerRange(5, 3)
    with Model(path, [(0, 3), (3, 7)]) as model:
        with pytest.raises(WindowRangeError, match="outside"):
            model.window(3, 9)
        with pytest.raises(WindowRangeError, match="does not reach the last layer"):
            model.window(0, 3, output_hidden=False)
        with pytest.raises(WindowRangeError, match="output-only window"):
            model.window(3, 3)
    with Model(path, [(2, 4)], output=False) as model:
        with pytest.raises(WindowRangeError, match="was not loaded for"):
            model.window(1, 4)
        with pytest.raises(WindowRangeError, match="output=False"):
            model.window(7, 7)


def test_native_engine_refuses_bad_windows_too(model_dir) -> None:
    """The C API checks its input itself: a NULL context and a logged reason, not a crash."""
    path = synthetic_path(model_dir, "llama", 7, "Q8_0")
    with Model(path, [(0, 7)]) as model:
        _log.take_errors()
        for start, end, hidden in ((0, 9, True), (-1, 3, True), (5, 2, True), (0, 3, False), (2, 2, False)):
            ctx = _native.llama_init_window_from_model(model._ptr, SETTINGS.params(), start, end, hidden)
            assert not ctx, (start, end, hidden)
            assert "window" in _log.take_errors()


def test_bad_forward_input(model_dir) -> None:
    path = synthetic_path(model_dir, "llama", 7, "Q8_0")
    with Model(path, [(0, 3), (3, 7)]) as model:
        first, last = model.window(0, 3, settings=SETTINGS), model.window(3, 7, settings=SETTINGS)
        with pytest.raises(ValueError, match="token ids must lie in"):
            first.forward([1, 2, 10_000], 0)
        with pytest.raises(ValueError, match=r"hidden states shaped \(n, 256\)"):
            last.forward(np.zeros((2, 100), np.float32), 0)
        with pytest.raises(ValueError, match="positions"):
            first.forward([1, 2, 3], [0, 1])
