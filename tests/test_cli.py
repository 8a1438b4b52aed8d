"""`primaplug run` generates through windows and checks itself against plain llama-cpp-python."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from primaplug.decoding import Sampler, SamplingParams
from tests.conftest import synthetic_path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "primaplug", *args], capture_output=True, text=True, timeout=300)


def test_run_two_rounds_matches_plain_llama(model_dir) -> None:
    path = synthetic_path(model_dir, "qwen2", 9, "Q8_0")
    out = run_cli("run", "-m", str(path), "-p", "ab cd", "-n", "12", "--layers", "1,2", "--rounds", "3",
                  "--temp", "0.7", "--seed", "5", "-c", "256", "--verify")
    assert out.returncode == 0, out.stderr
    assert "gave the same 12 tokens" in out.stderr
    assert "TTFT" in out.stderr and "TPOT" in out.stderr and "tokens/s" in out.stderr
    assert "[0, 1) [1, 3) [3, 4) [4, 6) [6, 7) [7, 9)" in out.stderr


def test_run_reports_bad_split(model_dir) -> None:
    path = synthetic_path(model_dir, "qwen2", 9, "Q8_0")
    out = run_cli("run", "-m", str(path), "--layers", "2,2", "-n", "2")
    assert out.returncode == 2
    assert "cover 4 layers, the model has 9" in out.stderr
    out = run_cli("run", "-m", str(path), "--rounds", "2", "-n", "2")
    assert out.returncode == 2 and "--rounds must divide" in out.stderr


def test_sampler_greedy_and_seeded() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert Sampler(SamplingParams(temperature=0))(logits) == int(np.argmax(logits))
    draws = [Sampler(SamplingParams(temperature=1.0, top_k=5, seed=7))(logits) for _ in range(3)]
    assert len(set(draws)) == 1 and draws[0] in np.argsort(logits)[-5:]


def test_verify_without_a_seed_replays_the_drawn_seed(model_dir) -> None:
    path = synthetic_path(model_dir, "llama", 7, "Q8_0")
    out = run_cli("run", "-m", str(path), "-p", "ab", "-n", "10", "--temp", "1.0", "-c", "128", "--verify")
    assert out.returncode == 0, out.stderr
    # the drawn seed may sample the end-of-generation token before -n runs out: compare what was generated
    generated = re.search(r"generated (\d+);", out.stderr)
    assert "(seed " in out.stderr and generated, out.stderr
    assert 1 <= int(generated[1]) <= 10
    assert f"gave the same {generated[1]} tokens" in out.stderr, out.stderr


def test_plan_refuses_a_split_by_hand() -> None:
    for extra in (["--scheduler", "even"], ["--layers", "3,3"]):
        out = run_cli("plan", "--local-nodes", "2", *extra)
        assert out.returncode == 2 and "nothing to plan" in out.stderr, out.stderr


def test_synth_refuses_to_overwrite_and_bad_sizes(tmp_path) -> None:
    existing = tmp_path / "m.gguf"
    existing.write_bytes(b"x")
    out = run_cli("synth", str(existing), "--size", "1M")
    assert out.returncode == 2 and "exists; pass --force" in out.stderr and existing.read_bytes() == b"x"
    out = run_cli("synth", str(tmp_path / "n.gguf"), "--size", "lots")
    assert out.returncode == 2 and "a size like 1.5G" in out.stderr
    out = run_cli("synth", str(tmp_path / "n.gguf"), "--size", "1M", "--type", "Q3_X")
    assert out.returncode == 2 and "--type must be one of" in out.stderr and not (tmp_path / "n.gguf").exists()


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
