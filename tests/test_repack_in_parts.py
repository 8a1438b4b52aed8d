"""A layer larger than a build's memory is repacked in parts of its weights (engine/repacked.py, patches/0024), and
gives the same bytes as repacked whole: llama.cpp holds what it repacks in anonymous memory, so a phone given one
layer of a large mixture of experts was killed writing it whole."""

from __future__ import annotations

import ctypes
import shutil
import threading
from pathlib import Path

import pytest

from tests.conftest import synthetic_path


def _moe(model_dir: Path) -> Path:
    return synthetic_path(model_dir, "qwen3moe", 7, "Q4_K_M")


def _repacked_names(path: Path, layer: int, only: set[str] | None) -> set[str]:
    """The weights llama.cpp holds repacked after loading one CPU layer, told to repack `only` (None: all)."""
    from llama_cpp import llama_cpp as ll

    from primaplug.engine import _native, read_layout

    placement = (ctypes.c_uint8 * (read_layout(path).n_layer_all + 1))()
    placement[layer] = _native.LLAMA_WINDOW_PLACEMENT_CPU
    names: set[str] = set()
    callback = _native.llama_repacked_tensor_callback(lambda name, _d, _n, _u: names.add(name.decode()))
    ptr = _native.load_for_windows(str(path), placement, repack=True, purpose="in a test", repack_only=only)
    try:
        _native.llama_model_repacked_tensors(ptr, callback, None)
    finally:
        ll.llama_model_free(ptr)
    return names


def test_llama_cpp_repacks_only_the_weights_it_is_told(model_dir: Path) -> None:
    path = _moe(model_dir)
    every = _repacked_names(path, 2, None)
    if not every:
        pytest.skip("this CPU's llama.cpp repacks no weight type: nothing to repack in parts")
    assert all(n.startswith("blk.2.") for n in every) and len(every) > 2
    one = sorted(every)[0]
    assert _repacked_names(path, 2, {one}) == {one}
    assert _repacked_names(path, 2, {one, "blk.5.attn_q.weight"}) == {one}  # a layer not loaded stays out
    assert _repacked_names(path, 2, set()) == set()
    assert _repacked_names(path, 2, None) == every, "the filter is cleared after the load"


def _spy_loads(monkeypatch: pytest.MonkeyPatch) -> list[frozenset[str] | None]:
    """Record what each load of a build was told to repack."""
    from primaplug.engine import _native

    seen: list[frozenset[str] | None] = []
    load = _native.load_for_windows

    def spy(*args: object, repack_only: frozenset[str] | None = None, **kw: object) -> int:
        seen.append(repack_only)
        return load(*args, repack_only=repack_only, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_native, "load_for_windows", spy)
    return seen


def test_a_copy_written_in_parts_is_the_copy_written_whole(model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.engine import read_layout
    from primaplug.engine.repacked import CHUNK_BYTES, repacked_copy

    layout = read_layout(_moe(model_dir))
    whole = repacked_copy(layout, [1, 2, 3], output=True, cache_dir=tmp_path / "whole", chunk_bytes=CHUNK_BYTES)
    if not whole.repacked:
        pytest.skip("this CPU's llama.cpp repacks no weight type: nothing to repack in parts")
    seen = _spy_loads(monkeypatch)
    largest = max(t.nbytes for il in (1, 2, 3) for t in layout.layer_tensors(il))
    parts = repacked_copy(layout, [1, 2, 3], output=True, cache_dir=tmp_path / "parts", chunk_bytes=largest)
    assert sum(1 for only in seen if only is not None) > 3, "each layer was loaded in parts"
    assert all(len(only) >= 1 for only in seen if only is not None)
    assert parts.repacked == whole.repacked and parts.repacked_bytes == whole.repacked_bytes
    assert Path(parts.path).read_bytes() == Path(whole.path).read_bytes()
    assert (Path(parts.path).with_suffix(".json").read_text() == Path(whole.path).with_suffix(".json").read_text())


class _Forms:
    """A record of what is repacked in place, as a node's fetched copy keeps it (store/copy.py)."""

    def __init__(self) -> None:
        self.forms: dict[str, dict[str, str]] = {}
        self.lock = threading.RLock()
        self.saved = 0

    def save(self) -> None:
        self.saved += 1


def test_repacking_in_place_in_parts_gives_the_same_file_and_record(model_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.engine import read_layout
    from primaplug.engine.repacked import CHUNK_BYTES, can_repack_in_place, repack_in_place

    source = _moe(model_dir)
    if not can_repack_in_place(read_layout(source), [1, 2], output=False):
        pytest.skip("this CPU repacks a weight that engine/unrepack.py cannot undo: no repacking in place")
    got = {}
    for name, chunk in (("whole", CHUNK_BYTES), ("parts", 1)):
        path = tmp_path / f"{name}.gguf"
        shutil.copyfile(source, path)
        forms = _Forms()
        seen = _spy_loads(monkeypatch)
        copy = repack_in_place(read_layout(path), forms, [1, 2], output=False, chunk_bytes=chunk)
        if not copy.repacked:
            pytest.skip("this CPU's llama.cpp repacks no weight type: nothing to repack in parts")
        if name == "parts":
            assert sum(1 for only in seen if only is not None) > 2, "each layer was loaded in parts"
            assert forms.saved == 2, "a unit in parts is recorded once, when every part is written"
        assert not forms.lock._is_owned(), "the lock held over a unit's parts is let go"  # type: ignore[attr-defined]
        got[name] = (path.read_bytes(), forms.forms)
    assert got["parts"][1] == got["whole"][1]
    assert got["parts"][0] == got["whole"][0]


def test_a_load_that_would_not_fit_is_refused_before_it_is_loaded(model_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.core.errors import EngineError
    from primaplug.engine import read_layout
    from primaplug.engine.repacked import repacked_copy

    layout = read_layout(_moe(model_dir))
    largest = max(t.nbytes for t in layout.layer_tensors(1))
    seen = _spy_loads(monkeypatch)
    with pytest.raises(EngineError, match=r"writing the repacked copy of layer 1 \(\d+ of its weights\) \(once\) "
                                          r"takes \d+ MiB of memory at once, and this device has 0 MiB available "
                                          r"\(a weight is repacked whole: the largest here, blk\.1\.ffn_\w+_exps"):
        repacked_copy(layout, [1], output=False, cache_dir=tmp_path, chunk_bytes=1, room=lambda: largest - 1)
    assert seen == [], "refused before llama.cpp loaded anything"
    copy = repacked_copy(layout, [1], output=False, cache_dir=tmp_path, chunk_bytes=1, room=lambda: largest)
    assert copy.built_bytes > 0, "a weight at a time fits where the largest weight does"


def test_weights_this_cpu_repacks_none_of_are_copied_without_loading_the_model(model_dir: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A load would only find nothing to repack: Gemma 3 270M through a 1 MiB budget on an AVX-512 Xeon was 110
    model loads of 0.6 s each. Where the engine's own probe (unrepack.repacks) says this CPU repacks none of a
    load's weights, the build copies their bytes and loads nothing; where it repacks some, the loads stay."""
    from primaplug.engine import read_layout, repacked
    from primaplug.engine.repacked import repacked_copy

    layout = read_layout(_moe(model_dir))
    seen = _spy_loads(monkeypatch)
    monkeypatch.setattr(repacked, "repacks", lambda _span: False)
    copy = repacked_copy(layout, [1, 2], output=True, cache_dir=tmp_path / "none", chunk_bytes=1 << 20)
    assert seen == [] and not copy.repacked and copy.built_bytes > 0
    with open(layout.path, "rb") as src, open(copy.path, "rb") as dst:
        for t in (t for il in (1, 2) for t in layout.layer_tensors(il)):
            src.seek(t.offset)
            dst.seek(t.offset)
            assert src.read(t.nbytes) == dst.read(t.nbytes), t.name
    monkeypatch.undo()
    seen = _spy_loads(monkeypatch)
    monkeypatch.setattr(repacked, "repacks", lambda _span: True)
    repacked_copy(layout, [1, 2], output=True, cache_dir=tmp_path / "some", chunk_bytes=1 << 20)
    assert seen, "weights the CPU may repack are still loaded to be repacked"
