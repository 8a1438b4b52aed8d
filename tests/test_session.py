"""The head's session, on node daemons in threads over the in-process transport: rewind, replay onto a new ring,
the failure policy under dropped, corrupted and lost messages, and conversations that go back and forth, all
checked against plain llama-cpp-python on the whole model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import synthetic_path, written_once
from tests.inproc_nodes import InprocNodes
from tests.ring_helpers import LLAMA_KWARGS

KWARGS = dict(LLAMA_KWARGS, n_threads=1)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Path:
    return synthetic_path(model_dir, "qwen3", 9, "Q4_K_M")


@pytest.fixture(scope="module")
def plain(model: Path):
    import llama_cpp

    llm = llama_cpp.Llama(str(model), **KWARGS)
    yield llm
    llm.close()


@pytest.fixture
def nodes(model: Path):
    with InprocNodes([model], 4) as nodes:
        yield nodes


def _ring(model: Path, nodes: InprocNodes, n_nodes: int = 2, **kwargs):
    import primaplug

    args = dict(KWARGS, nodes=nodes.addresses[:n_nodes], scheduler="even", transport=nodes.head_transport(),
                node_threads=1, timeout_s=1.0)
    return primaplug.Llama(model, **{**args, **kwargs})


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, size=n)]


def _plain_row(plain, *calls: list[int]) -> np.ndarray:
    """The last logits of plain llama-cpp-python after evaluating `calls` one after the other: in the same calls as
    the ring, since llama.cpp's kernels round a batch of rows differently from one row at a time."""
    plain.reset()
    for tokens in calls:
        plain.eval(tokens)
    return np.array(plain.scores[plain.n_tokens - 1])


def _close(a: np.ndarray, b: np.ndarray) -> None:
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max(), "logits differ from plain llama-cpp-python"


def _positions(nodes: InprocNodes, i: int) -> int:
    """How many positions node i's caches hold."""
    return nodes.nodes[i]._deployment.device.kv_pos_max() + 1


def test_a_rewind_is_forgotten_on_every_device_with_the_next_batch(model: Path, nodes: InprocNodes, plain) -> None:
    prompt = _prompt(40)
    llm = _ring(model, nodes)
    try:
        llm.eval(prompt + [7, 8, 9])
        assert [_positions(nodes, i) for i in (0, 1)] == [43, 43]
        llm.session.rewind(41)  # no trip: the devices keep the positions until the next batch
        assert [_positions(nodes, i) for i in (0, 1)] == [43, 43] and llm.session.n_past == 41
        llm.n_tokens = 41
        llm.eval([11])  # starts at 41: every device forgets 41 and after, then computes it
        assert [_positions(nodes, i) for i in (0, 1)] == [42, 42] and llm.session.held == 42
        plain.reset()
        plain.eval([*prompt, 7, 8, 9])
        plain.n_tokens = 41  # plain llama-cpp-python's own rewind: its eval removes positions 41 and after
        plain.eval([11])
        _close(llm.scores[41], np.array(plain.scores[41]))
        with pytest.raises(Exception, match="the ring holds 42 positions"):
            llm.session.eval([1], 50)
    finally:
        llm.close()


def test_replay_rebuilds_the_prefix_on_a_new_ring(model: Path, nodes: InprocNodes, plain) -> None:
    from primaplug.head import Cluster, ClusterSettings
    from primaplug.head.batching import Batcher
    from primaplug.head.events import SessionChanged

    prompt = _prompt(70, seed=1)
    llm = _ring(model, nodes, layers=[4, 5])
    seen: list[SessionChanged] = []
    llm.events.subscribe(lambda e: seen.append(e) if isinstance(e, SessionChanged) else None)
    transport = nodes.head_transport()
    settings = ClusterSettings(nodes=tuple(nodes.addresses[2:]), layers=(6, 3), n_ctx=KWARGS["n_ctx"],
                               n_batch=KWARGS["n_batch"], n_ubatch=KWARGS["n_ubatch"], n_threads=1, timeout_s=1.0)
    other = Cluster(transport, settings, llm.cluster.model, llm.events)
    batcher = None
    try:
        llm.eval(prompt)
        other.connect()
        other.plan()
        other.deploy()
        batcher = Batcher(other.ring(None), llm._batcher.output, n_batch=KWARGS["n_batch"])
        llm.session.replay(batcher)
        assert [_positions(nodes, i) for i in (2, 3)] == [70, 70]  # the new ring holds the prefix
        llm.eval([5])  # and goes on from it, on the new split
        assert [_positions(nodes, i) for i in (2, 3)] == [71, 71] and _positions(nodes, 0) == 70
        _close(llm.scores[70], _plain_row(plain, prompt, [5]))
        assert [e.what for e in seen][-2:] == ["clear", "replay"] and seen[-1].n_past == 70
    finally:
        if batcher is not None:
            batcher.close()
        other.close()
        llm.close()


def test_a_lost_message_is_sent_again_on_the_same_ring(model: Path, nodes: InprocNodes, plain) -> None:
    """A message lost on the way (a short network drop) with every node there: the session replays onto the same
    assignment, no node loads anything, and the call goes on."""
    prompt = _prompt(30, seed=2)
    llm = _ring(model, nodes)
    try:
        llm.eval(prompt)
        epoch = llm.cluster.epoch
        nodes.faults.drop_ring()  # the next ring message a node sends is lost
        llm.eval([3])
        assert any(line.startswith("drop ring") for line in nodes.faults.log), nodes.faults.log
        assert llm.cluster.epoch == epoch and llm.reforms == []
        _close(llm.scores[30], _plain_row(plain, prompt, [3]))
        assert [_positions(nodes, i) for i in (0, 1)] == [31, 31]
    finally:
        llm.close()


def test_a_refused_batch_is_an_error_and_the_next_request_replays(model: Path, nodes: InprocNodes, plain) -> None:
    from primaplug.core.errors import NodeError

    prompt = _prompt(30, seed=2)
    llm = _ring(model, nodes)
    try:
        llm.eval(prompt)
        nodes.faults.corrupt_ring()  # its rows arrive a byte short: the next node refuses them, every node is there
        with pytest.raises(NodeError, match="buffer holds"):
            llm.eval([3])
        assert any(line.startswith("corrupt ring") for line in nodes.faults.log), nodes.faults.log
        assert llm.n_tokens == 30  # llama-cpp-python's view is untouched: it asks again from position 30
        llm.eval([3])
        _close(llm.scores[30], _plain_row(plain, prompt, [3]))
        assert [_positions(nodes, i) for i in (0, 1)] == [31, 31]
    finally:
        llm.close()


def test_a_dead_node_is_named_and_the_ring_re_forms_without_it(model: Path, nodes: InprocNodes, plain) -> None:
    """The node is named within the timeout, the split by hand is rescaled to the nodes left (the head keeps its
    windows), and the call goes on there with the logits of an uninterrupted run (at k = 1 and 2 on real processes:
    tests/test_recovery.py)."""
    rounds = 3
    prompt = _prompt(20, seed=4)
    per_round = 9 // rounds // 3  # 9 layers; the head runs only the output layer
    llm = _ring(model, nodes, n_nodes=3, rounds=rounds, layers=[per_round] * 3)
    seen: list = []
    llm.events.subscribe(seen.append)
    try:
        llm.eval(prompt)
        nodes.kill(1)
        llm.eval([3])
        _close(llm.scores[20], _plain_row(plain, prompt, [3]))
        (r,) = llm.reforms
        # the request's watch or the heartbeat, whichever noticed first (the test evaluates outside a request)
        assert r.lost == ("node2",) and "node2" in r.why, r
        assert [n.name for n in llm.cluster.nodes] == ["node1", "node3"]
        assert llm.cluster.node_sizes() == [2, 1], llm.cluster.node_sizes()
        assert "rescaled" in r.plan
        assert [_positions(nodes, i) for i in (0, 2)] == [21, 21]  # the prefix replayed, then the token
        assert any(type(e).__name__ == "Reformed" for e in seen)
    finally:
        llm.close()


def test_conversations_that_extend_diverge_and_repeat(model: Path, nodes: InprocNodes) -> None:
    """llama-cpp-python's prefix reuse over the ring, with batches smaller than the prompts: the same tokens as a
    plain llama_cpp.Llama that goes through the same requests."""
    import llama_cpp

    kwargs = dict(KWARGS, logits_all=False, n_batch=16, n_ubatch=8)
    a, b, c = _prompt(20, 3), _prompt(25, 4), _prompt(3, 5)
    requests = [a, a + b, a + c, a, a + b[:10] + c, c, b]
    llm = _ring(model, nodes, **kwargs)
    ref = llama_cpp.Llama(str(model), **kwargs)
    try:
        for prompt in requests:
            got = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
            want = ref.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
            assert got == want, f"prompt of {len(prompt)} tokens"
    finally:
        ref.close()
        llm.close()


def test_the_head_alone_runs_the_same_path(model: Path) -> None:
    """No nodes: the head chains the windows itself, through the same Llama, session and ring code."""
    import llama_cpp

    import primaplug

    kwargs = dict(KWARGS, logits_all=False, n_batch=16)
    prompt = _prompt(40, 6)
    ref = llama_cpp.Llama(str(model), **kwargs)
    llm = primaplug.Llama(model, layers=[2, 3, 4], **kwargs)
    try:
        assert [str(w.layers) for w in llm.session.ring.ring.local.windows] == ["[0, 2)", "[2, 5)", "[5, 9)"]
        got = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        assert got == ref.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    finally:
        ref.close()
        llm.close()


def test_the_head_streams_its_own_windows_as_a_node_does(model_dir: Path) -> None:
    """A memory budget smaller than the head's windows: they stream (prefetched, released) on the device layer,
    as a node's do. F32 weights, which llama.cpp never repacks, so the tokens must be plain llama's to the bit."""
    import llama_cpp

    import primaplug
    from primaplug.engine.synthetic import SyntheticSpec, write_synthetic_gguf

    path = written_once(model_dir / "llama-6L-F32-head-stream.gguf", lambda out: write_synthetic_gguf(
        out, SyntheticSpec(arch="llama", n_layer=6, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, seed=6)))
    kwargs = dict(KWARGS, logits_all=False)
    prompt = _prompt(20, 7)
    ref = llama_cpp.Llama(str(path), **kwargs)
    llm = primaplug.Llama(path, layers=[3, 3], memory_budget=1 << 20, **kwargs)
    try:
        device = llm.session.ring.ring.local
        assert device.plan.prefetch.mode == "stream" and device.prefetcher is not None
        got = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        assert got == ref.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        assert device.prefetcher.wait_idle(5) and device.prefetcher.stats.bytes_released > 0
    finally:
        ref.close()
        llm.close()


def test_an_engine_failure_is_one_sentence_naming_window_node_and_cause(model: Path, nodes: InprocNodes) -> None:
    """A batch at positions the nodes' caches do not lead up to (sent past the session, as a bug would): llama.cpp
    refuses it, and the head hears which node, which window, and why, in words."""
    from primaplug.core.errors import NodeError

    llm = _ring(model, nodes)
    try:
        llm.eval(_prompt(10))
        with pytest.raises(NodeError) as e:
            llm.session.ring.forward([3], 15)
        text = str(e.value)
        assert text.startswith("node node1")
        assert "window [0, 4) could not compute 1 tokens at positions 15..15" in text
        assert "does not hold the positions before these" in text, text
    finally:
        llm.close()


def test_removing_positions_from_the_middle_is_refused_and_changes_nothing(model: Path, nodes: InprocNodes) -> None:
    """llama-cpp-python's context API can ask to drop a span in the middle; over a ring only rewinding is offered,
    and the refusal leaves the conversation as it was."""
    from primaplug.core.errors import PrimaplugError

    llm = _ring(model, nodes)
    try:
        llm.eval(_prompt(12))
        with pytest.raises(PrimaplugError, match=r"removing positions \[3, 6\) from the middle .* only rewinding"):
            llm._ctx.kv_cache_seq_rm(0, 3, 6)
        assert llm.session.n_past == 12 and [_positions(nodes, i) for i in (0, 1)] == [12, 12]
    finally:
        llm.close()


def test_nodes_of_one_name_are_told_apart(model: Path, nodes: InprocNodes) -> None:
    """Two devices with the same host name: the head names each by its address too, in its events and its view."""
    for n in nodes.nodes[:2]:
        n.name = "vm"
    llm = _ring(model, nodes)
    try:
        names = [n.name for n in llm.cluster.nodes]
        assert names == [f"vm@{a}" for a in nodes.addresses[:2]]
        assert set(llm.events.view.nodes) == set(names) and all(v.state == "ready"
                                                               for v in llm.events.view.nodes.values())
    finally:
        llm.close()


def test_a_replay_rebuilds_recurrent_states_on_a_new_ring(model_dir: Path) -> None:
    """Qwen 3.5's delta-net layers keep a state per sequence on the node that runs them: a replay onto a new ring
    (the decoded tokens joined into one batch) rebuilds them, and the next token's logits are plain
    llama-cpp-python's after the same steps one by one."""
    import llama_cpp

    from primaplug.head import Cluster, ClusterSettings
    from primaplug.head.batching import Batcher

    path = synthetic_path(model_dir, "qwen35", 7, "Q8_0")
    prompt, decoded = _prompt(40, seed=2), [5, 9, 13, 21, 34]
    plain = llama_cpp.Llama(str(path), **KWARGS)
    with InprocNodes([path], 4) as nodes:
        llm = _ring(path, nodes, layers=[3, 4])
        settings = ClusterSettings(nodes=tuple(nodes.addresses[2:]), layers=(4, 3), n_ctx=KWARGS["n_ctx"],
                                   n_batch=KWARGS["n_batch"], n_ubatch=KWARGS["n_ubatch"], n_threads=1,
                                   timeout_s=1.0)
        other = Cluster(nodes.head_transport(), settings, llm.cluster.model, llm.events)
        batcher = None
        try:
            llm.eval(prompt)
            for t in decoded:
                llm.eval([t])
            other.connect()
            other.plan()
            other.deploy()
            batcher = Batcher(other.ring(None), llm._batcher.output, n_batch=KWARGS["n_batch"])
            llm.session.replay(batcher)
            llm.eval([55])
            _close(llm.scores[len(prompt) + len(decoded)], _plain_row(plain, prompt, *[[t] for t in decoded], [55]))
        finally:
            if batcher is not None:
                batcher.close()
            other.close()
            llm.close()
            plain.close()
