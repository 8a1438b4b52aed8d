"""distributed-llama (b4rtaz/distributed-llama): tensor parallelism on CPUs. `dllama worker` on every device but the
first, `dllama inference` there as the root; the root reads the model and sends each worker its slice of every
layer, which the worker holds in memory. Its node count is a power of two and at most the model's KV heads (the
root says so itself, in a log kept with the row); its weights are Q40 (its own `.m` format, no GGUF), its buffers
Q80.

Built from a checkout given by path, by its README (`make dllama`, peer_systems/builds.py). Its model file is
written here from the GGUF's shapes (`write_model`): the same architecture, sizes and vocabulary, with random Q40
weights, in the format its converter writes (a header of (key, value) pairs, then the tensors in a fixed order). So
its tokens are not compared with the GGUF's: its weights are other numbers, and Q40 rather than Q4_K.
"""

from __future__ import annotations

import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.peer_systems import builds
from benchmarks.peer_systems.base import Job, Outcome, last_lines, stdout_tpot, watch_first_output
from benchmarks.peer_systems.rig import Rig, free_port_block, wait_listening

NAME = "distributed-llama"
MAGIC, TOKENIZER_MAGIC = 0xA00ABCD, 0x567124
ARCH = {"llama": 0xABCD00, "qwen3": 0xABCD01, "qwen3moe": 0xABCD02}
F32, Q40 = 0, 2
# header keys, as its converter numbers them
KEYS = {"version": 0, "arch_type": 1, "dim": 2, "hidden_dim": 3, "n_layers": 4, "n_heads": 5, "n_kv_heads": 6,
        "n_experts": 7, "n_active_experts": 8, "vocab_size": 9, "max_seq_len": 10, "hidden_act": 11, "rope_theta": 12,
        "weights_float_type": 13, "head_dim": 19, "norm_epsilon": 20, "moe_hidden_dim": 21}
PRED = re.compile(r"Pred\s*(\d+) ms Sync\s*(\d+) ms")
EVAL = re.compile(r"Eval\s*(\d+) ms Sync\s*(\d+) ms")
# what the root prints where it refuses a model or a node count (src/app.cpp: runInferenceApp), before any weight
REFUSAL = re.compile(r"This version (?:does not support|supports only)[^\n]*")


MAKE = ["make", "dllama"]


def binary(bin_dir: Path) -> Path:
    return bin_dir / "dllama"


def build(src: Path, cache: Path, logs: Path) -> Path:
    """dllama built from the checkout `src` (cached); returns the folder that holds it."""
    return builds.cached(NAME, builds.checkout(src), [MAKE], {"dllama": "dllama"}, cache,
                         logs / "distributed-llama-build.log")


def build_info(bin_dir: Path) -> dict[str, str]:
    return builds.summary(bin_dir) | {"binary": "dllama"}


@dataclass(frozen=True)
class Shapes:
    arch: str
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    head_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0
    n_active_experts: int = 0
    moe_hidden_dim: int = 0


def shapes_of(gguf: Path) -> Shapes:
    """The shapes of a GGUF model, for a distributed-llama file of the same model."""
    from gguf import GGUFReader

    r = GGUFReader(gguf)

    def get(key: str, default: float | None = None) -> float:
        f = r.fields.get(key)
        if f is None:
            if default is None:
                raise KeyError(f"{gguf.name} has no {key}")
            return default
        return f.parts[f.data[0]][0].item()

    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    if arch not in ARCH:
        raise ValueError(f"distributed-llama has no architecture {arch!r} (it has {', '.join(ARCH)})")
    dim, n_heads = int(get(f"{arch}.embedding_length")), int(get(f"{arch}.attention.head_count"))
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return Shapes(arch=arch, dim=dim, hidden_dim=int(get(f"{arch}.feed_forward_length")),
                  n_layers=int(get(f"{arch}.block_count")), n_heads=n_heads,
                  n_kv_heads=int(get(f"{arch}.attention.head_count_kv")), vocab_size=vocab,
                  head_dim=int(get(f"{arch}.attention.key_length", dim // n_heads)),
                  rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
                  norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                  n_experts=int(get(f"{arch}.expert_count", 0)),
                  n_active_experts=int(get(f"{arch}.expert_used_count", 0)),
                  moe_hidden_dim=int(get(f"{arch}.expert_feed_forward_length", 0)))


def _q40(rng: np.random.Generator, rows: int, cols: int, scale: float) -> bytes:
    """Random Q40 blocks: an f16 scale and 32 four-bit values in 16 bytes, for rows x cols weights."""
    n = rows * cols // 32
    blocks = np.empty((n, 18), dtype=np.uint8)
    blocks[:, :2] = np.full(n, scale / 8, dtype=np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:] = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return blocks.tobytes()


def _f32(values: np.ndarray) -> bytes:
    return values.astype("<f4").tobytes()


def write_model(s: Shapes, path: Path, seed: int = 0) -> Path:
    """A distributed-llama model of these shapes with random Q40 weights (written once; a .tmp first)."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    eps = {1e-5: 5, 1e-6: 6}.get(round(s.norm_eps, 7), 5)
    header = {"version": 0, "arch_type": ARCH[s.arch], "dim": s.dim, "hidden_dim": s.hidden_dim,
              "n_layers": s.n_layers, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads,
              "n_experts": s.n_experts, "n_active_experts": s.n_active_experts, "vocab_size": s.vocab_size,
              "max_seq_len": 4096, "hidden_act": 1, "rope_theta": int(s.rope_theta), "weights_float_type": Q40,
              "head_dim": s.head_dim, "norm_epsilon": eps, "moe_hidden_dim": s.moe_hidden_dim}
    data = b"".join(struct.pack("<ii", KEYS[k], v) for k, v in header.items())
    q_dim, kv_dim, w = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, 0.02 * 8
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<ii", MAGIC, 8 + len(data)) + data)
        f.write(_f32(rng.standard_normal((s.vocab_size, s.dim), dtype=np.float32)))
        for _ in range(s.n_layers):
            for rows, cols in ((q_dim, s.dim), (kv_dim, s.dim), (kv_dim, s.dim), (s.dim, q_dim)):
                f.write(_q40(rng, rows, cols, w))
            if s.n_experts:
                f.write(_f32(rng.standard_normal((s.n_experts, s.dim), dtype=np.float32) * 0.02))
                experts = [(s.moe_hidden_dim, s.dim), (s.dim, s.moe_hidden_dim), (s.moe_hidden_dim, s.dim)]
                for _e in range(s.n_experts):
                    for rows, cols in experts:
                        f.write(_q40(rng, rows, cols, w))
            else:
                for rows, cols in ((s.hidden_dim, s.dim), (s.dim, s.hidden_dim), (s.hidden_dim, s.dim)):
                    f.write(_q40(rng, rows, cols, w))
            if s.arch in ("qwen3", "qwen3moe"):  # q_norm, k_norm
                f.write(_f32(np.ones(s.head_dim)) + _f32(np.ones(s.head_dim)))
            f.write(_f32(np.ones(s.dim)) + _f32(np.ones(s.dim)))  # the attention's and the FFN's input norms
        f.write(_f32(np.ones(s.dim)))
        f.write(_q40(rng, s.vocab_size, s.dim, w))
    tmp.rename(path)
    return path


def write_tokenizer(gguf: Path, path: Path) -> Path:
    """The GGUF's vocabulary as distributed-llama's tokenizer file: the same pieces and scores (_piece), BOS and
    EOS."""
    from gguf import GGUFReader

    if path.exists():
        return path
    r = GGUFReader(gguf)
    f_tok, f_score = r.fields["tokenizer.ggml.tokens"], r.fields["tokenizer.ggml.scores"]
    tokens = [_piece(bytes(f_tok.parts[i]).decode()) for i in f_tok.data]
    scores = [float(f_score.parts[i][0]) for i in f_score.data]
    bos = int(r.fields["tokenizer.ggml.bos_token_id"].parts[-1][0])
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    params = {0: 1, 1: len(tokens), 2: max(len(t) for t in tokens), 3: bos, 9: 1, 10: 1}  # version .. add_bos
    data = b"".join(struct.pack("<ii", k, v) for k, v in params.items())
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<ii", TOKENIZER_MAGIC, 8 + len(data)) + data + struct.pack("<i", eos))
        for t, sc in zip(tokens, scores, strict=True):
            f.write(struct.pack("<fI", sc, len(t)) + t)
    tmp.rename(path)
    return path


def _piece(token: str) -> bytes:
    """A SentencePiece token as distributed-llama's tokenizer holds it: '▁' a space, a byte token <0xNN> its byte
    (its encoder starts from single characters, each of which must be a token)."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode()


def unsupported(n_nodes: int) -> str | None:
    """Why the harness does not start distributed-llama on n_nodes, or None: it slices every layer into equal
    parts, one a node, and its README runs 1, 2, 4, 8 ... of them. Its other limits (at most the model's KV heads)
    it says itself when run (`refusal`)."""
    if n_nodes & (n_nodes - 1):
        return f"unsupported: distributed-llama runs on 1, 2, 4, 8 ... nodes, not {n_nodes}"
    return None


def refusal(text: str) -> str | None:
    """The root's own refusal of this model or node count in its output, as it printed it, or None."""
    m = REFUSAL.search(text)
    return f"unsupported: {m.group(0).strip()}" if m else None


def run(bin_dir: Path, rig: Rig, job: Job, on_first_token: callable, model: Path, tokenizer: Path,  # type: ignore[valid-type]
        prompt_tokens: int) -> Outcome:
    """The root on device 0, workers on the others of job.extra["devices"] (default: every device);
    job.extra["net_turbo"] False: its blocking network mode (--net-turbo 0) instead of the default polling one."""
    used = job.extra.get("devices", list(range(len(rig.devices))))
    turbo = [] if job.extra.get("net_turbo", True) else ["--net-turbo", "0"]
    port = free_port_block(len(rig.devices))
    workers = []
    for i in used[1:]:
        workers.append(rig.spawn(i, [str(binary(bin_dir)), "worker", "--port", str(port + i), "--nthreads",
                                     str(job.threads[i]), *turbo], job.logs / f"worker-{rig.devices[i].name}.log",
                                 name=f"worker {rig.devices[i].name}"))
    for i, wk in zip(used[1:], workers, strict=True):
        if not wait_listening(wk, port + i, 30):
            return Outcome("failed", error=f"{wk.name} did not start: {last_lines(wk.text())}")
    addresses = [rig.link(0, f"tcp://127.0.0.1:{port + i}", to=i).removeprefix("tcp://") for i in used[1:]]
    argv = [str(binary(bin_dir)), "inference", "--model", str(rig.copy(0, model)), "--tokenizer",
            str(rig.copy(0, tokenizer)), "--buffer-float-type", "q80", "--prompt", job.prompt,
            "--steps", str(prompt_tokens - 1 + job.tokens), "--nthreads", str(job.threads[0]),
            "--max-seq-len", str(job.n_ctx), "--temperature", "0", "--seed", "0", *turbo]
    if addresses:
        argv += ["--workers", *addresses]
    root = rig.spawn(0, argv, job.logs / f"root-{rig.devices[0].name}.log", name="dllama root")
    stop = threading.Event()
    watch_first_output(root, lambda out: b"Pred" in out, on_first_token, stop)
    code = root.wait(job.timeout_s)
    stop.set()
    split = (" ".join(f"{rig.devices[i].name} 1/{len(used)}" for i in used) + " of every layer (tensor parallel)"
             + (", --net-turbo 0" if turbo else ""))
    text = root.text()
    if code is None:
        return Outcome("failed", split=split, error=f"the root did not finish within {job.timeout_s:.0f} s")
    preds = [int(a) + int(b) for a, b in PRED.findall(text)]
    if code != 0 and (why := refusal(text)):
        return Outcome("unsupported", split=split, error=why)
    if code != 0 or not preds:
        dead = [w.name for w in workers if w.proc.poll() is not None]
        return Outcome("failed", split=split, error=f"dllama inference exited with status {code}"
                       + (f"; {', '.join(dead)} stopped" if dead else "") + f": {last_lines(text)}")
    evals = sum(int(a) + int(b) for a, b in EVAL.findall(text))
    # its first prediction step evaluates the prompt's last token: the first token comes after it
    return Outcome(ttft_s=(evals + preds[0]) / 1e3, tpot_s=stdout_tpot(root, len(preds), lambda c: b"Pred" in c),
                   split=split, detail={"pred_ms": preds, "eval_ms": evals, "own_tpot_s": sum(preds[1:]) / max(
                       1, len(preds) - 1) / 1e3, "weights": "Q40 (not the GGUF's Q4_K)"})
