"""Where a head's model comes from (store/hub.py): a model in several files, merged once into one; a Hugging Face
reference, fetched through huggingface_hub from a local server standing in for the Hub (tests/fake_hub.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from primaplug.core.errors import ConfigError
from primaplug.engine import read_layout
from primaplug.head.launch import LocalNodes
from tests.fake_hub import fake_hub

ROOT = Path(__file__).resolve().parents[1]


def split_gguf(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """Write `src` as a model in several files (`out`'s stem-0000i-of-0000n.gguf), as llama.cpp's gguf-split does."""
    r = GGUFReader(src)
    w = GGUFWriter(out, r.fields["general.architecture"].contents(), split_max_tensors=max_tensors)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


@pytest.fixture
def parts(streaming_model: Path, tmp_path: Path) -> list[Path]:
    folder = tmp_path / "repo"
    folder.mkdir()
    return split_gguf(streaming_model, folder / "llama-8L", max_tensors=20)


def _last_logits(path: Path) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False)  # eval keeps scores only with it
    tokens = list(range(5, 25))
    llm.eval(tokens)
    logits = np.array(llm.scores[len(tokens) - 1])
    assert np.isfinite(logits).all() and logits.std() > 0
    return logits


def test_a_model_in_several_files_is_merged_once_into_the_same_model(parts: list[Path], streaming_model: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from primaplug.store import resolve_model

    assert len(parts) == 4
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))
    merged = resolve_model(parts[2])  # any part names the model
    assert merged == resolve_model(parts[0]) and merged.parent == tmp_path / "cache" / "merged"
    assert read_layout(merged).identity == read_layout(streaming_model).identity  # both written by llama.cpp
    # the same logits as the file it was split from, and the same bytes wherever it is merged (the identity a
    # head and a node must agree on)
    assert np.array_equal(_last_logits(merged), _last_logits(streaming_model))
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "elsewhere"))
    again = resolve_model(parts[1])
    assert again != merged and again.read_bytes() == merged.read_bytes()
    parts[3].unlink()
    with pytest.raises(ConfigError, match=f"{parts[3].name} is not beside it"):
        resolve_model(parts[0])


def _hub_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"),
            "PRIMAPLUG_CACHE": str(tmp_path / "cache"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_hugging_face_references_are_fetched_once_from_the_hub(parts: list[Path], streaming_model: Path,
                                                               tmp_path: Path) -> None:
    single = parts[0].parent / "tiny-Q8_0.gguf"
    single.write_bytes(streaming_model.read_bytes())
    script = ("import sys; from primaplug.store import resolve_model; "
              "print(*(resolve_model(a) for a in sys.argv[1:]), sep='\\n')")
    refs = ["hf://org/repo/tiny-Q8_0.gguf", "org/repo:q8_0", "hf://org/repo/llama-8L-00003-of-00004.gguf"]
    with fake_hub("org/repo", parts[0].parent) as (endpoint, hub):
        got = subprocess.run([sys.executable, "-c", script, *refs], capture_output=True, text=True,
                             env=_hub_env(endpoint, tmp_path), timeout=120, cwd=ROOT)
        assert got.returncode == 0, got.stderr
        paths = [Path(p) for p in got.stdout.split()]
        assert paths[0].read_bytes() == single.read_bytes() and paths[1] == paths[0]
        # llama.cpp's quantizer wrote the file that was split: merged by it again, it is that file, byte for byte
        assert read_layout(paths[2]).identity == read_layout(single).identity
        fetched = [r for r in hub.requests if r.startswith("GET /org/repo/resolve/")]
        assert len(fetched) == 1 + len(parts)  # every part once; the second reference was in the cache
        again = subprocess.run([sys.executable, "-c", script, "org/repo:Q4_K_M", "hf://org/repo/missing.gguf"],
                               capture_output=True, text=True, env=_hub_env(endpoint, tmp_path), timeout=120, cwd=ROOT)
    assert again.returncode != 0 and "names 0 GGUF models" in again.stderr


@pytest.mark.multiproc
def test_a_split_model_from_the_hub_on_a_head_and_a_node_that_holds_its_parts(parts: list[Path], tmp_path: Path
                                                                              ) -> None:
    """The head names the model on the Hub; one node holds the parts itself (and merges them), the other fetches
    its layers from the head: `run --verify` gives plain's tokens and logits."""
    with fake_hub("org/repo", parts[0].parent) as (endpoint, _):
        env = _hub_env(endpoint, tmp_path)
        with LocalNodes([parts[0], None], 2, log_dir=tmp_path / "logs",
                        node_args=[[], ["--model-dir", str(tmp_path / "d2"), "--disk-budget", "1024"]]) as nodes:
            got = subprocess.run([sys.executable, "-m", "primaplug", "run", "-m", "hf://org/repo/" + parts[1].name,
                                  "--nodes", ",".join(nodes.addresses), "--scheduler", "even", "--temp", "0", "-n", "8",
                                  "-p", "Once upon a time", "--verify"], capture_output=True, text=True, env=env,
                                 timeout=300, cwd=ROOT)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "gave the same 8 tokens, and the same logits for each" in got.stderr
