"""Real `primaplug node` processes on loopback, driven by primaplug.Llama: same tokens and logits as plain
llama-cpp-python on the whole model, for one and several rounds, uneven windows and multi-batch prompts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import synthetic_path
from tests.ring_helpers import LLAMA_KWARGS, THREADS, assert_same, greedy_scores

pytestmark = pytest.mark.multiproc

STEPS = 32


@pytest.fixture(scope="module")
def models(model_dir: Path, gemma_path: Path) -> dict[str, Path]:
    return {"gemma": gemma_path,
            "llama9": synthetic_path(model_dir, "llama", 9, "Q4_K_M"),
            "qwen2_9": synthetic_path(model_dir, "qwen2", 9, "Q8_0"),
            "qwen3_7": synthetic_path(model_dir, "qwen3", 7, "Q8_0"),
            "qwen3moe_7": synthetic_path(model_dir, "qwen3moe", 7, "Q4_K_M"),
            "mistral3_7": synthetic_path(model_dir, "mistral3", 7, "Q8_0"),
            "granite_7": synthetic_path(model_dir, "granite", 7, "Q8_0"),
            "gpt_oss_7": synthetic_path(model_dir, "gpt-oss", 7, "MXFP4_MOE"),
            "glm4moe_7": synthetic_path(model_dir, "glm4moe", 7, "Q4_K_M"),
            "gemma2_7": synthetic_path(model_dir, "gemma2", 7, "Q8_0"),
            "olmo2_7": synthetic_path(model_dir, "olmo2", 7, "Q8_0"),
            "phi3_7": synthetic_path(model_dir, "phi3", 7, "Q8_0"),
            "qwen35_7": synthetic_path(model_dir, "qwen35", 7, "Q8_0"),
            "qwen35moe_7": synthetic_path(model_dir, "qwen35moe", 7, "Q4_K_M"),
            "gemma4_7": synthetic_path(model_dir, "gemma4", 7, "Q4_K_M"),
            "gemma4_e2b_7": synthetic_path(model_dir, "gemma4-e2b", 7, "Q4_K_M"),
            "llama4_7": synthetic_path(model_dir, "llama4", 7, "Q4_K_M"),
            "lfm2_7": synthetic_path(model_dir, "lfm2", 7, "Q8_0"),
            "deepseek2_7": synthetic_path(model_dir, "deepseek2", 7, "Q4_K_M"),
            "lfm2moe_7": synthetic_path(model_dir, "lfm2moe", 7, "Q4_K_M"),
            "qwen3next_7": synthetic_path(model_dir, "qwen3next", 7, "Q4_K_M"),
            "minimax_m2_7": synthetic_path(model_dir, "minimax-m2", 7, "Q4_K_M"),
            "kimi_linear_7": synthetic_path(model_dir, "kimi-linear", 7, "Q4_K_M"),
            "deepseek32_7": synthetic_path(model_dir, "deepseek32", 7, "Q4_K_M"),
            "glm_dsa_7": synthetic_path(model_dir, "glm-dsa", 7, "Q4_K_M"),
            "glm_5_2_7": synthetic_path(model_dir, "glm-5.2", 7, "Q4_K_M")}


@pytest.fixture(scope="module")
def nodes(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Three node processes holding every test model; each test deploys its own assignment to them."""
    from primaplug.head.launch import LocalNodes

    extra = [a for p in list(models.values())[1:] for a in ("--model", str(p))]
    with LocalNodes(models["gemma"], 3, log_dir=tmp_path_factory.mktemp("node-logs"), extra_args=extra) as local:
        yield local


def _prompt(path: Path, text: bool) -> list[int]:
    """Text for a real tokenizer (the bundled Gemma); ids spread over the vocabulary for a synthetic one."""
    import llama_cpp

    from primaplug.engine import read_layout

    if text:
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        try:
            return llm.tokenize(b"Pipelined-ring parallelism splits a model into windows of layers. " * 8)
        finally:
            llm.close()
    n_vocab = read_layout(path).n_vocab
    return [3 + (i * 7919) % (n_vocab - 3) for i in range(100)]  # longer than n_batch (64) and n_ubatch (32)


CASES = [  # model, layers per round (node, node, node[, head]) or None for an even split, rounds
    ("gemma", None, 1),
    ("gemma", (3, 3, 3), 2),
    ("gemma", (5, 7, 4, 2), 1),
    ("llama9", (2, 3, 3, 1), 1),
    ("qwen2_9", (1, 1, 1), 3),
    ("qwen3_7", (1, 4, 2), 1),
    ("qwen3moe_7", (2, 3, 1, 1), 1),  # mixture of experts, the head holding the last layer
    ("mistral3_7", (2, 2, 3), 1),
    ("granite_7", (3, 2, 1, 1), 1),
    ("gpt_oss_7", (2, 2, 2, 1), 1),  # MXFP4 experts and sliding windows, the head holding the last layer
    ("glm4moe_7", (1, 3, 2, 1), 1),  # the dense first layer on one node; the NextN layer on none
    ("gemma2_7", (2, 2, 3), 1),
    ("olmo2_7", (3, 3, 1), 1),
    ("phi3_7", (2, 3, 2), 1),
    ("qwen35_7", (3, 1, 2, 1), 1),  # recurrent layers, one on the head
    ("qwen35moe_7", (2, 3, 1, 1), 1),
    ("gemma4_7", (2, 2, 2, 1), 1),  # the head holding a global layer
    # per-layer inputs: the head's input window computes them, each node takes its own and passes the rest on, and
    # the head holds the layers that share keys and values
    ("gemma4_e2b_7", (2, 1, 1, 3), 1),
    ("llama4_7", (1, 2, 3, 1), 1),
    ("lfm2_7", (2, 1, 3, 1), 1),  # a node holding one attention layer alone
    ("deepseek2_7", (1, 2, 3, 1), 1),  # latent attention: the dense first layer alone, a MoE layer on the head
    ("lfm2moe_7", (2, 2, 2, 1), 1),  # convolutions and experts; the head holding a convolution
    ("qwen3next_7", (1, 2, 3, 1), 1),  # a node holding one delta-net layer alone
    ("minimax_m2_7", (3, 1, 2, 1), 1),
    ("kimi_linear_7", (2, 2, 2, 1), 1),  # each node a delta-attention layer and a latent one
    ("deepseek32_7", (2, 1, 3, 1), 1),  # sparse attention: each window's indexer keys on its own node
    ("glm_dsa_7", (1, 3, 2, 1), 1),
    ("glm_5_2_7", (1, 1, 4, 1), 1),  # GLM 5.2: the window of layers 2-5 holds the indexer 3-5 share
]


@pytest.mark.parametrize(("model", "layers", "rounds"), CASES, ids=lambda c: str(c))
def test_ring_matches_plain_llama(nodes, models, model: str, layers, rounds: int) -> None:
    import llama_cpp

    import primaplug

    path = models[model]
    prompt = _prompt(path, text=model == "gemma")
    plain = llama_cpp.Llama(str(path), **LLAMA_KWARGS)
    try:
        expected = greedy_scores(plain, prompt, STEPS)
    finally:
        plain.close()
    split = dict(layers=layers) if layers else dict(scheduler="even")  # Halda would keep the model on the head
    ring = primaplug.Llama(path, nodes=nodes.addresses, rounds=rounds, node_threads=THREADS, **split, **LLAMA_KWARGS)
    try:
        assert [n.name for n in ring.cluster.nodes] == nodes.names  # every node is in the ring
        got = greedy_scores(ring, prompt, STEPS)
        assert_same(got, expected)
        # the same ring, reused: the KV caches on the nodes were cleared by reset() + eval
        assert greedy_scores(ring, prompt[:40], 4)[0] == greedy_scores(ring, prompt[:40], 4)[0]
    finally:
        ring.close()


def test_per_layer_inputs_travel_only_as_far_as_the_nodes_need_them(nodes, models) -> None:
    """Gemma 4 E2B/E4B: the head's input window computes every layer's per-layer input, the rows that go round carry
    those of the nodes' layers only (0-3 here), and the head puts back those of its own window (the shared-KV tail,
    4-6), which it kept: nothing is left kept once the tokens are out, and they are plain's (the case above)."""
    import primaplug
    from primaplug.engine import read_layout

    path = models["gemma4_e2b_7"]
    layout = read_layout(path)
    ring = primaplug.Llama(path, nodes=nodes.addresses, layers=(2, 1, 1, 3), node_threads=THREADS, **LLAMA_KWARGS)
    try:
        driver = ring._batcher.ring
        assert driver.keep_from == 4 and driver.entry is not None
        widths: list[tuple[int, int]] = []
        send = driver.send
        driver.send = lambda msg, rows, what: (widths.append((msg.width, msg.per_layer)), send(msg, rows, what))[1]
        ring.create_completion([5, 6, 7, 8, 9], max_tokens=4, temperature=0.0)
        assert widths and set(widths) == {(layout.row_width(0, 4), 4 * layout.n_embd_per_layer)}
        assert layout.row_width(0, 4) < layout.row_width(0) and not driver._kept
    finally:
        ring.close()


def test_chat_completion_streams_the_same_text(nodes, models) -> None:
    import llama_cpp

    import primaplug

    messages = [{"role": "user", "content": "Name three primary colors."}]
    kwargs = dict(LLAMA_KWARGS, logits_all=False, chat_format="gemma")  # the GGUF carries no chat template

    def stream(llm) -> list[str]:
        chunks = llm.create_chat_completion(messages, temperature=0.0, max_tokens=32, stream=True, seed=1)
        return [c["choices"][0]["delta"].get("content", "") for c in chunks]

    plain = llama_cpp.Llama(str(models["gemma"]), **kwargs)
    try:
        expected = stream(plain)
    finally:
        plain.close()
    ring = primaplug.Llama(models["gemma"], nodes=nodes.addresses, layers=(6, 4, 4, 4), node_threads=THREADS, **kwargs)
    try:
        got = stream(ring)
        assert len(got) > 3, "the completion should stream in several chunks"
        assert "".join(got) == "".join(expected)
        again = ring.create_chat_completion(messages, temperature=0.0, max_tokens=32)  # prefix reuse, no stream
        assert again["choices"][0]["message"]["content"] == "".join(expected)
    finally:
        ring.close()


def test_node_threads_sleep_between_tokens(nodes, models) -> None:
    """A node's compute threads poll while its window computes and are put to sleep right after: while the other
    devices compute (here: nobody), a node takes no CPU."""
    import psutil

    import primaplug

    ring = primaplug.Llama(models["gemma"], nodes=nodes.addresses, layers=(6, 6, 6), node_threads=2,
                           **LLAMA_KWARGS)
    try:
        greedy_scores(ring, _prompt(models["gemma"], text=True)[:20], 4)
        procs = [psutil.Process(n.proc.pid) for n in nodes.nodes]
        before = [sum(p.cpu_times()[:2]) for p in procs]
        time.sleep(1.0)
        used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before, strict=True)]
        assert max(used) < 0.1, f"node CPU seconds in one idle second: {used}"
    finally:
        ring.close()
