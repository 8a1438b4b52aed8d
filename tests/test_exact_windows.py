"""Windows compute exactly as plain llama-cpp-python at any memory budget: resident or streamed, whatever the
prefetch switches and the number of rounds, because the weights llama.cpp repacks for its faster CPU kernels are
mapped from a repacked copy of the file (engine/repacked.py, patches/0008)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.ring_helpers import LLAMA_KWARGS, THREADS, assert_same, greedy_scores

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies these tests write go to one folder of the session, not the user's cache."""
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _plain(path: Path, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    from primaplug.engine.reference import plain_llama

    with plain_llama(path, **LLAMA_KWARGS) as llm:
        return greedy_scores(llm, prompt, steps)


def _ring(path: Path, prompt: list[int], steps: int, layers: list[int], **kw: object) -> tuple[list[int], np.ndarray]:
    import primaplug

    llm = primaplug.Llama(path, layers=layers, **kw, **LLAMA_KWARGS)
    try:
        return greedy_scores(llm, prompt, steps)
    finally:
        llm.close()


def _split(n_layer: int, k: int) -> list[int]:
    return [n_layer // k + (1 if i < n_layer % k else 0) for i in range(k)]


def test_every_model_streamed_matches_plain_llama(test_model) -> None:
    """Every architecture and quantization of the tests, its windows streamed one at a time from a budget far
    under one window, against plain llama-cpp-python on the whole model."""
    from primaplug.engine import read_layout

    layout = read_layout(test_model.path)
    prompt = list(test_model.prompt)
    steps = 3 if test_model.name == "gemma3-270m" else 8  # every Gemma token streams its 100 MB of layers again
    plain = _plain(test_model.path, prompt, steps)
    split = layout.snap_sizes(_split(layout.n_layer, 2))  # GLM 5.2: windows start at layers with their own indexer
    assert_same(_ring(test_model.path, prompt, steps, split, memory_budget=1 * MiB), plain)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("budget", ["fits", "half", "window", "tiny"])
def test_any_budget_and_rounds_match_plain_llama(model_dir: Path, k: int, budget: str) -> None:
    """From everything fitting down to one window at a time, for k = 1 to 4 rounds, on a Q4_K_M model (whose
    matrices this CPU repacks, where it repacks anything)."""
    from primaplug.engine import read_layout
    from tests.conftest import synthetic_path

    path = synthetic_path(model_dir, "qwen3", 9, "Q4_K_M")
    layout = read_layout(path)
    weights = sum(layout.layer_bytes(il) for il in range(layout.n_layer))
    split = _split(layout.n_layer, k)
    window = max(sum(layout.layer_bytes(il) for il in range(sum(split[:i]), sum(split[: i + 1])))
                 for i in range(k))
    bytes_ = {"fits": None, "half": weights // 2, "window": window, "tiny": 256 * 1024}[budget]
    prompt = [3 + 7 * i for i in range(70)]
    assert_same(_ring(path, prompt, 6, split, memory_budget=bytes_), _plain(path, prompt, 6))


@pytest.mark.parametrize("switch", ["prefetch", "release", "keep", "layers"])
def test_memory_switches_do_not_change_the_output(streaming_model: Path, model_dir: Path, switch: str) -> None:
    """Each part of the memory policy on or off (the ablations), streaming, on a Q8_0 and a Q4_K_M model."""
    from primaplug.memory.prefetcher import Switches
    from tests.conftest import synthetic_path

    default = Switches()
    switches = Switches(**{switch: not getattr(default, switch)})
    prompt = [5 + 3 * i for i in range(40)]
    for path in (streaming_model, synthetic_path(model_dir, "llama", 9, "Q4_K_M")):
        ring = _ring(path, prompt, 6, [3, 3, 3] if "9L" in path.name else [4, 4], memory_budget=2 * MiB,
                     memory_switches=switches)
        assert_same(ring, _plain(path, prompt, 6))


def test_the_copy_is_written_once_sparse_and_names_what_it_holds(model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.engine import Model, read_layout
    from primaplug.engine.repacked import default_dir
    from tests.conftest import synthetic_path

    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path))
    path = synthetic_path(model_dir, "llama", 9, "Q4_K_M")
    layout = read_layout(path)
    with Model(path, [(2, 5)], output=False) as m:
        copy = m.copy
        assert copy is not None and Path(copy.path).parent == default_dir()
        assert copy.built_bytes > 0 and copy.repacked_bytes > 0, "this CPU repacks Q4_K: some bytes are repacked"
    with Model(path, [(2, 5)], output=False) as again:
        assert again.copy is not None and again.copy.built_bytes == 0, "the second load writes nothing"
    st = os.stat(copy.path)
    assert st.st_size == layout.file_size, "same size and offsets as the model file"
    layers = sum(layout.layer_bytes(il) for il in range(2, 5))
    assert st.st_blocks * 512 < layers + layout.data_offset + 4 * MiB, "only the layers used are written"
    manifest = json.loads(Path(copy.path).with_suffix(".json").read_text())
    assert sorted(manifest["units"]) == ["blk.2", "blk.3", "blk.4", "globals"]
    with Model(path, [(0, 9)]) as whole:  # the missing layers and the output layer are added to the same copy
        assert whole.copy is not None and whole.copy.path == copy.path and whole.copy.built_bytes > 0


def test_without_the_copy_the_kernels_round_differently(model_dir: Path) -> None:
    """The test above can fail: the file's bytes as they are (repack=False) give other logits on this CPU."""
    from primaplug.core import LayerRange
    from primaplug.engine import ContextSettings, Model, WindowChain
    from primaplug.engine.reference import plain_llama_forward
    from tests.conftest import synthetic_path

    path = synthetic_path(model_dir, "llama", 9, "Q4_K_M")
    settings = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS)
    prompt = [3 + 5 * i for i in range(40)]
    windows = [LayerRange(0, 5), LayerRange(5, 9)]
    with plain_llama_forward(path, settings) as plain:
        expected = plain(prompt, 0)
    got = {}
    for repack in (True, False):
        with Model(path, windows, repack=repack) as m:
            got[repack] = WindowChain(m, windows, settings=settings).forward(prompt, 0)
            if repack and not m.copy.repacked:
                pytest.skip("this CPU repacks nothing: both ways run the same kernels")
    scale = float(np.abs(expected).max())
    exact, raw = (float(np.abs(got[r].ravel() - expected).max()) / scale for r in (True, False))
    print(f"largest logit difference, of the largest logit: {exact:.1e} mapped repacked, {raw:.1e} as in the file")
    assert exact <= 1e-5, "the output layer alone may round its one row apart from plain's batch, no more"
    assert raw > 100 * max(exact, 1e-7)


def test_a_disk_without_room_for_the_copy_is_named(model_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from primaplug.core.errors import EngineError
    from primaplug.engine import Model
    from tests.conftest import synthetic_path

    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path))
    path = synthetic_path(model_dir, "llama", 9, "Q4_K_M")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage._replace(free=1 << 20))
    with pytest.raises(EngineError, match=r"needs .* GiB in .*repacked, which has 0\.00 GiB free.*PRIMAPLUG_CACHE"):
        Model(path, [(0, 9)])


def test_an_unreadable_manifest_makes_the_copy_anew(model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while writing, or a damaged cache: the copy is written again, never trusted half-made."""
    from primaplug.engine import Model
    from tests.conftest import synthetic_path

    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path))
    path = synthetic_path(model_dir, "llama", 9, "Q4_K_M")
    prompt = [3 + 5 * i for i in range(40)]
    with Model(path, [(0, 9)]) as m:
        Path(m.copy.path).with_suffix(".json").write_text("{not json")
    with Model(path, [(0, 9)]) as again:
        assert again.copy is not None and again.copy.built_bytes > 0
    assert_same(_ring(path, prompt, 4, [9]), _plain(path, prompt, 4))
