"""GPU layers on a real GPU: a ring whose nodes run layers on their GPU (-ngl), and the head alone with -ngl, give the
tokens of the same layers on the same GPU unsplit and of plain llama-cpp-python; the profiler reads the GPU and
Halda gives it layers. tests/test_gpu_fakes.py covers every GPU code path with fakes; this file needs the GPU.

On a machine with an NVIDIA GPU (docs/gpu.md):

    make engine GPU=cuda                                  # or: python scripts/build_engine.py --gpu cuda
    .venv/bin/python -m pytest tests/test_gpu_layers.py -v

Everything here is skipped, saying why, where the engine has no GPU backend (built for cpu) or llama.cpp finds no
GPU device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from primaplug.profiler import gpu
from tests.inproc_nodes import InprocNodes
from tests.ring_helpers import LLAMA_KWARGS, assert_same, greedy_scores

pytestmark = pytest.mark.skipif(
    gpu.engine_backend() == "cpu",
    reason="the engine has no GPU backend (built for cpu): on a machine with a GPU, `make engine GPU=cuda`, then "
           "run this file")

STEPS = 24
TEXT = "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of the hill"


@pytest.fixture(scope="module", autouse=True)
def gpu_device() -> str:
    from primaplug.engine.model import ggml_devices

    backends, device = ggml_devices()
    if device is None:
        pytest.skip(f"the engine has the {', '.join(backends)} backend(s) but llama.cpp finds no GPU device")
    return device


@pytest.fixture(autouse=True)
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Repacked copies in a cache of this file's own: the shared one (~/.cache/primaplug/repacked) is mapped by other
    test runs of the machine, and these tests must not depend on what they wrote there (docs/gpu.md)."""
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path_factory.getbasetemp() / "gpu-layers-cache"))


@pytest.fixture(scope="module")
def prompt(gemma_path: Path) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(gemma_path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(TEXT.encode())
    finally:
        llm.close()


@pytest.fixture
def nodes(gemma_path: Path) -> Iterator[InprocNodes]:
    with InprocNodes([gemma_path], 2) as nodes:
        yield nodes


def _ring(gemma_path: Path, nodes: InprocNodes, **kwargs: object):
    import primaplug

    return primaplug.Llama(gemma_path, nodes=nodes.addresses, layers=[9, 9], transport=nodes.head_transport(),
                           node_threads=2, **{**LLAMA_KWARGS, **kwargs})


def _plain(gemma_path: Path, prompt: list[int], n_gpu_layers: int) -> tuple[list[int], np.ndarray]:
    import llama_cpp

    return _generate(llama_cpp.Llama(str(gemma_path), n_gpu_layers=n_gpu_layers, **LLAMA_KWARGS), prompt)


def _generate(llm, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """The prompt, then STEPS greedy tokens (greedy_scores); the Llama is closed after."""
    try:
        return greedy_scores(llm, prompt, STEPS)
    finally:
        llm.close()


def _unsplit(gemma_path: Path, prompt: list[int], gpu_layers: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """The whole model in one window of the engine, `gpu_layers` on the GPU (the output layer on the CPU, as on the
    head): greedy tokens and the logits of the prompt's last row and of every step."""
    from primaplug.engine import ContextSettings, Model

    settings = ContextSettings(n_ctx=LLAMA_KWARGS["n_ctx"], n_batch=LLAMA_KWARGS["n_batch"],
                               n_ubatch=LLAMA_KWARGS["n_ubatch"], n_threads=LLAMA_KWARGS["n_threads"])
    with Model(gemma_path, [(0, 18)], gpu_layers=gpu_layers) as m:
        w = m.window(0, 18, settings=settings)
        rows = [np.asarray(w.forward(np.array(prompt, dtype=np.int32), 0), dtype=np.float32).ravel()]
        tokens: list[int] = []
        for i in range(STEPS):
            tokens.append(int(np.argmax(rows[-1])))
            rows.append(np.asarray(w.forward(np.array(tokens[-1:], dtype=np.int32), len(prompt) + i),
                                   dtype=np.float32).ravel())
        w.close()
    return tokens, np.array(rows)


def _from_last_prompt_row(run: tuple[list[int], np.ndarray], prompt: list[int]) -> tuple[list[int], np.ndarray]:
    tokens, rows = run
    return tokens, rows[len(prompt) - 1:]


def test_the_profiler_reads_this_gpu_and_halda_gives_it_layers(gemma_path: Path, tmp_path: Path) -> None:
    from primaplug.engine import read_layout
    from primaplug.profiler import model_types, profile_device, profile_model
    from primaplug.scheduler import solve

    layout = read_layout(gemma_path)
    model = profile_model(layout, n_ctx=4096, n_batch=512, n_ubatch=512)
    p = profile_device("gpu-box", model_types=model_types(model), cache_dir=tmp_path, model_path=gemma_path,
                       layer_bytes=model.layer_bytes)
    assert p.backend == gpu.engine_backend() and p.has_gpu
    assert p.gpu_flops and all(f > 0 for f in p.gpu_flops.values()), "the GPU was not timed (see the log)"
    if p.backend == "cuda":
        assert p.vram_free_bytes > 0 and p.h2d_bps > 0 and p.d2h_bps > 0 and p.gpu_read_bps > 0
    else:  # Metal: the working set is its memory
        assert p.metal_working_set_bytes > 0
    plan = solve([p], model, latency_model="ring")
    assert plan.head.n > 0, plan.describe()


def test_a_ring_without_gpu_layers_on_a_gpu_engine_matches_plain(gemma_path: Path, nodes: InprocNodes,
                                                                 prompt: list[int]) -> None:
    ring = _generate(_ring(gemma_path, nodes), prompt)
    assert_same(ring, _plain(gemma_path, prompt, 0))


def test_a_ring_with_gpu_layers_matches_the_same_layers_on_the_gpu_unsplit(gemma_path: Path, nodes: InprocNodes,
                                                                          prompt: list[int]) -> None:
    # node1 [0, 9): 0-3 on its GPU; node2 [9, 18): all
    ring = _generate(_ring(gemma_path, nodes, node_gpu_layers=[4, 9]), prompt)
    assert_same(_from_last_prompt_row(ring, prompt), _unsplit(gemma_path, prompt, [*range(4), *range(9, 18)]))


def test_the_head_alone_with_ngl_matches_the_same_layers_on_the_gpu_unsplit(gemma_path: Path,
                                                                            prompt: list[int]) -> None:
    import primaplug

    llm = primaplug.Llama(gemma_path, layers=[9, 9], node_gpu_layers=4, **LLAMA_KWARGS)  # its two windows: 0-3, 9-12
    alone = _generate(llm, prompt)
    assert_same(_from_last_prompt_row(alone, prompt), _unsplit(gemma_path, prompt, [*range(4), *range(9, 13)]))


def test_a_ring_with_every_layer_on_the_gpu_gives_plain_llama_cpp_python_s_tokens(gemma_path: Path,
                                                                                   nodes: InprocNodes,
                                                                                   prompt: list[int]) -> None:
    """Plain llama.cpp's n_gpu_layers puts the last N of the n_layer + 1 layers on the GPU, the output layer first;
    the ring's head runs the output layer on its CPU. With every layer on the GPU the two differ only there: the
    same tokens, and logits that agree to the rounding of one matrix product (1e-2 of a row's largest)."""
    tokens, rows = _generate(_ring(gemma_path, nodes, node_gpu_layers=9), prompt)
    plain_tokens, plain_rows = _plain(gemma_path, prompt, -1)
    assert tokens == plain_tokens, "greedy tokens differ from plain llama-cpp-python with every layer on the GPU"
    diff = np.abs(rows - plain_rows).max(axis=1) / np.abs(plain_rows).max(axis=1)
    assert diff.max() <= 1e-2, f"logits differ by up to {diff.max():.2e} of the row's largest"
