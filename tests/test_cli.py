"""The `primaplug` command: `run` generates through primaplug.Llama (the head alone, or a ring of local nodes, the
README's main command) and checks itself against plain llama-cpp-python; the other commands' errors and help."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import synthetic_path


def same(n: int) -> str:
    """What `run --verify` says when the ring gave plain's n tokens and plain's logits for each, bit for bit."""
    return f"gave the same {n} tokens, and the same logits for each"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "primaplug", *args], capture_output=True, text=True, timeout=300)


def test_run_two_rounds_matches_plain_llama(model_dir) -> None:
    path = synthetic_path(model_dir, "qwen2", 9, "Q8_0")
    out = run_cli("run", "-m", str(path), "-p", "ab cd", "-n", "12", "--layers", "1,2", "--rounds", "3",
                  "--temp", "0.7", "--seed", "5", "-c", "256", "--verify")
    assert out.returncode == 0, out.stderr
    assert same(12) in out.stderr
    assert "TTFT" in out.stderr and "TPOT" in out.stderr and "tokens/s" in out.stderr
    assert "[0, 1) [1, 3) [3, 4) [4, 6) [6, 7) [7, 9)" in out.stderr


def test_run_reports_bad_split(model_dir) -> None:
    path = synthetic_path(model_dir, "qwen2", 9, "Q8_0")
    out = run_cli("run", "-m", str(path), "--layers", "2,2", "-n", "2")
    assert out.returncode == 2
    assert "cover 4 layers, the model has 9" in out.stderr
    out = run_cli("run", "-m", str(path), "--rounds", "2", "-n", "2")
    assert out.returncode == 2 and "rounds must divide the model's 9 layers, got 2" in out.stderr


def test_a_model_no_window_runs_is_refused_before_any_local_node_starts(tmp_path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "deepseek4.gguf"
    w = GGUFWriter(str(path), "deepseek4")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = run_cli("run", "-m", str(path), "--local-nodes", "2", "-n", "2")
    assert out.returncode == 2 and "started" not in out.stderr, out.stderr
    assert "architecture 'deepseek4' cannot run in layer windows: its hyper-connections" in out.stderr
    assert "supported architectures: llama" in out.stderr


def test_a_local_node_that_cannot_start_says_why_in_the_heads_error(tmp_path) -> None:
    """Its own error line leads the head's message, before its exit status and log."""
    from primaplug.core.errors import PrimaplugError
    from primaplug.head.launch import LocalNodes

    with pytest.raises(PrimaplugError) as failed, LocalNodes(tmp_path / "missing.gguf", 1, log_dir=tmp_path) as nodes:
        nodes.start()
    first = str(failed.value).splitlines()[0]
    assert first.startswith("local node node1 did not start: model file ") and "does not exist (it exited" in first


def test_verify_without_a_seed_replays_the_drawn_seed(model_dir) -> None:
    path = synthetic_path(model_dir, "llama", 7, "Q8_0")
    out = run_cli("run", "-m", str(path), "-p", "ab", "-n", "10", "--temp", "1.0", "-c", "128", "--verify")
    assert out.returncode == 0, out.stderr
    # the drawn seed may sample the end-of-generation token before -n runs out: compare what was generated
    generated = re.search(r"generated (\d+);", out.stderr)
    assert "(seed " in out.stderr and generated, out.stderr
    assert 1 <= int(generated[1]) <= 10
    assert same(generated[1]) in out.stderr, out.stderr


def test_plan_refuses_a_split_by_hand() -> None:
    out = run_cli("plan", "--local-nodes", "2", "--scheduler", "even")
    assert out.returncode == 2 and "nothing to plan" in out.stderr, out.stderr
    out = run_cli("plan", "--local-nodes", "2", "--layers", "3,3")
    assert out.returncode == 2 and "unrecognized arguments: --layers" in out.stderr, out.stderr


@pytest.mark.multiproc
def test_the_readme_main_command_runs_a_ring_of_local_nodes() -> None:
    """`make run`'s command, shorter: three local node processes, an even split, checked against plain llama."""
    out = run_cli("run", "--local-nodes", "3", "--scheduler", "even", "-n", "12", "--temp", "0", "--verify")
    assert out.returncode == 0, out.stderr
    assert "ring of 3 node(s) + head, 1 round(s)" in out.stderr
    assert "node1 [0, 6); node2 [6, 12); node3 [12, 18); head the output layer only" in out.stderr
    assert same(12) in out.stderr and "stopped the 3 local nodes" in out.stderr


@pytest.mark.multiproc
def test_a_prompt_longer_than_the_batch_runs_through_the_ring() -> None:
    """The command that crashed the ring ("inconsistent sequence positions" on the output window): a prompt of 24
    tokens in batches of 16, so the ring returns the last row of each batch at positions 15 and 23."""
    out = run_cli("run", "--local-nodes", "2", "--scheduler", "even", "-n", "8", "--temp", "0", "-b", "16",
                  "--verify", "-p", "the quick brown fox jumps over the lazy dog while seven wizards hex a pale "
                  "jumbo sphinx of black quartz judges my vow")
    assert out.returncode == 0, out.stderr
    assert same(8) in out.stderr and "llama_" not in out.stderr, out.stderr


def test_a_prompt_longer_than_the_context_gets_llama_cpp_pythons_error() -> None:
    out = run_cli("run", "-c", "8", "-p", "one two three four five six seven eight nine ten", "-n", "4")
    assert out.returncode == 2, out.stderr
    assert "error: Requested tokens (11) exceed context window of 8" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "llama_" not in out.stderr


VERIFY_KWARGS = dict(n_ctx=128, verbose=False, seed=1)
VERIFY_SAMPLING = dict(temp=0.0, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def sky(gemma_path) -> tuple[list[int], list[int], np.ndarray]:
    """Plain llama-cpp-python's prompt tokens, 6 greedy tokens and their logits for "The sky is": what a ring that
    keeps its promise bit for bit would give `run --verify`."""
    from primaplug.cli.run import generated
    from primaplug.engine.reference import plain_llama, teacher_forced_logits

    with plain_llama(gemma_path, **VERIFY_KWARGS) as llm:
        prompt = llm.tokenize(b"The sky is")
        tokens = list(generated(llm, prompt, 6, VERIFY_SAMPLING))
        return prompt, tokens, teacher_forced_logits(llm, prompt, tokens)


def test_verify_says_where_the_tokens_first_differ(gemma_path, sky) -> None:
    from primaplug.cli.verify import RingOutput, verify

    (prompt, tokens, logits), kwargs, sampling = sky, VERIFY_KWARGS, VERIFY_SAMPLING
    one_cpu = {"head": "x86_64 AVX2", "node1": "x86_64 AVX2"}
    assert verify(gemma_path, "The sky is", RingOutput(prompt, tokens, logits, one_cpu), kwargs, sampling, 6) == 0
    changed = [*tokens[:3], tokens[3] + 1, *tokens[4:]]
    assert verify(gemma_path, "The sky is", RingOutput(prompt, changed, None, one_cpu), kwargs, sampling, 6) == 1
    # the same tokens from logits that are not plain's: refused on a ring of one CPU's kernels
    nudged = logits + np.float32(1e-3)
    assert verify(gemma_path, "The sky is", RingOutput(prompt, tokens, nudged, one_cpu), kwargs, sampling, 6) == 1


def test_verify_holds_a_ring_of_mixed_cpus_to_the_measured_distance(gemma_path, sky, capfd) -> None:
    from primaplug.cli.verify import MIXED_KERNELS_TOLERANCE, RingOutput, verify

    (prompt, tokens, logits), kwargs, sampling = sky, VERIFY_KWARGS, VERIFY_SAMPLING
    mixed = {"head": "x86_64 AVX2 FMA", "phone": "aarch64 NEON DOTPROD"}
    assert not RingOutput(prompt, tokens, None, mixed).exact
    assert not RingOutput(prompt, tokens, None, {"head": "x86_64 AVX2 FMA + GPU"}).exact  # GPU kernels round apart
    assert RingOutput(prompt, tokens, None, {"head": "x86_64 AVX2 FMA", "old node": ""}).exact
    scale = np.abs(logits).max(axis=1, keepdims=True)  # the tolerance is a fraction of each row's largest |logit|
    rounded = logits + (MIXED_KERNELS_TOLERANCE / 2) * scale
    assert verify(gemma_path, "The sky is", RingOutput(prompt, tokens, rounded, mixed), kwargs, sampling, 6) == 0
    err = capfd.readouterr().err
    assert "mixes kernels" in err and "aarch64 NEON DOTPROD" in err and "within the mixed-kernel promise" in err
    # far from plain's logits: outside the promise, though every token is plain's
    far = logits.copy()
    far[:, :1] += 2 * MIXED_KERNELS_TOLERANCE * scale
    assert verify(gemma_path, "The sky is", RingOutput(prompt, tokens, far, mixed), kwargs, sampling, 6) == 1
    # a token that is not plain's where plain's choice was no near tie: outside it too
    changed = [*tokens[:3], tokens[3] + 1, *tokens[4:]]
    assert verify(gemma_path, "The sky is", RingOutput(prompt, changed, logits, mixed), kwargs, sampling, 6) == 1
    assert "more than twice the rounding distance" in capfd.readouterr().err


def test_node_help_documents_port_zero_and_relays() -> None:
    out = run_cli("node", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "port 0: any free ports" in text and "window of 0 layers" in text and "relays" in text


def test_synth_refuses_to_overwrite_and_bad_sizes(tmp_path) -> None:
    existing = tmp_path / "m.gguf"
    existing.write_bytes(b"x")
    out = run_cli("synth", str(existing), "--size", "1M")
    assert out.returncode == 2 and "exists; pass --force" in out.stderr and existing.read_bytes() == b"x"
    out = run_cli("synth", str(tmp_path / "n.gguf"), "--size", "lots")
    assert out.returncode == 2 and "a size like 1.5G" in out.stderr
    out = run_cli("synth", str(tmp_path / "n.gguf"), "--size", "1M", "--type", "Q3_X")
    assert out.returncode == 2 and "--type must be one of" in out.stderr and not (tmp_path / "n.gguf").exists()


def test_synth_writes_a_mixture_of_experts_that_runs_split_like_plain(tmp_path) -> None:
    """`synth --arch gpt-oss`: MXFP4 experts (their biases F32, as ggml adds only F32), sized as asked, and a ring
    of two local nodes gives plain llama-cpp-python's tokens on it."""
    from primaplug.engine import read_layout

    path = tmp_path / "oss.gguf"
    out = run_cli("synth", str(path), "--arch", "gpt-oss", "--type", "MXFP4_MOE", "--size", "12M", "--layers", "4",
                  "--experts", "16", "--experts-used", "4")
    assert out.returncode == 0, out.stderr
    assert "gpt-oss, 4 layers" in out.stderr and "16 experts" in out.stderr and "4 a token" in out.stderr
    layout = read_layout(path)
    assert (layout.arch, layout.n_expert, layout.n_expert_used) == ("gpt-oss", 16, 4)
    assert {t.type_name for t in layout.layer_tensors(0) if "_exps.weight" in t.name} == {"MXFP4"}
    assert {t.type_name for t in layout.layer_tensors(0) if t.name.endswith(".bias")} == {"F32"}
    assert 6e6 < path.stat().st_size < 24e6
    out = run_cli("run", "-m", str(path), "--local-nodes", "2", "--layers", "2,2", "-p", "ab cd", "-n", "8",
                  "--temp", "0", "--verify")
    assert out.returncode == 0 and same(8) in out.stderr, out.stderr
    out = run_cli("synth", str(tmp_path / "x.gguf"), "--arch", "qwen3moe", "--size", "1M", "--experts", "4",
                  "--experts-used", "5")
    assert out.returncode == 2 and "--experts-used must be between 1 and --experts (4)" in out.stderr


def test_an_unknown_scheduler_is_refused_before_anything_opens() -> None:
    import primaplug
    from primaplug.core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown scheduler 'fastest'.*halda, memory, compute or even"):
        primaplug.Llama("no-such-model.gguf", nodes=["127.0.0.1:1"], scheduler="fastest")


def test_gpu_layers_are_refused_with_a_planned_scheduler_or_a_wrong_count() -> None:
    import primaplug
    from primaplug.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"-ngl\) is for a split by hand.*the halda scheduler picks"):
        primaplug.Llama("no-such-model.gguf", nodes=["127.0.0.1:1"], node_gpu_layers=2)
    with pytest.raises(ConfigError, match=r"one count \(0 or more\) per node \(2\).*got \[1\]"):
        primaplug.Llama("no-such-model.gguf", nodes=["127.0.0.1:1", "127.0.0.1:2"], layers=[9, 9], node_gpu_layers=[1])


@pytest.mark.multiproc
def test_plan_and_run_with_a_draft(gemma_path) -> None:
    """`plan` says whether drafting pays on the ring (the draft timed on the head); `run` drafts, reports what was
    kept, and gives plain llama-cpp-python's tokens."""
    out = run_cli("plan", "--local-nodes", "2", "-m", str(gemma_path), "--model-draft", str(gemma_path), "-c", "512")
    assert out.returncode == 0, out.stderr
    assert re.search(r"speculation: a drafted token costs [\d.]+ ms, a trip round the ring [\d.]+ ms", out.stdout)
    # the plan is the command's output, once: not also among the progress lines on stderr
    assert out.stdout.count("plan by halda:") == 1 and "plan by halda" not in out.stderr, out.stderr
    text = "Text: one two three four five six seven eight. Again: one two three four five"
    out = run_cli("run", "-m", str(gemma_path), "--layers", "9,9", "--model-draft", "prompt-lookup", "--draft-min",
                  "2", "-p", text, "-n", "16", "--temp", "0", "-c", "512", "--verify")
    assert out.returncode == 0, out.stderr
    assert same(16) in out.stderr
    assert re.search(r"speculation: \d+/\d+ drafted tokens kept", out.stderr), out.stderr
    out = run_cli("run", "-m", str(gemma_path), "--model-draft", "prompt-lookup", "--draft-min", "3",
                  "--draft-max", "2")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "draft_min <= draft_max" in out.stderr and "got 3 and 2" in out.stderr


@pytest.mark.parametrize("args", [["--stream-room", "0"], ["--stream-room", "2", "--layer-streaming", "off"]])
def test_a_node_refuses_a_stream_room_it_cannot_use_before_anything_opens(args: list[str]) -> None:
    out = run_cli("node", "-m", "no-such-model.gguf", *args)
    assert out.returncode == 2 and "--stream-room" in out.stderr and "1 or more" in out.stderr, out.stderr
