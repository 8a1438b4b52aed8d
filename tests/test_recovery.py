"""A request survives losing a node, on real node processes: SIGKILL or SIGSTOP one of three mid-generation, at
k = 1 and k = 2 rounds, and the head re-plans the two left, deploys them under a new assignment, replays the
prefix and goes on: every token and logit row is plain llama-cpp-python's, as in an uninterrupted run."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.ring_helpers import LLAMA_KWARGS, assert_same, greedy_scores

pytestmark = pytest.mark.multiproc
STEPS = 24


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt, greedy tokens, logits) of plain llama-cpp-python: the uninterrupted run."""
    import llama_cpp

    plain = llama_cpp.Llama(str(gemma_path), **LLAMA_KWARGS)
    try:
        prompt = plain.tokenize(b"The history of distributed computing begins with")
        return (prompt, *greedy_scores(plain, prompt, STEPS))
    finally:
        plain.close()


@pytest.mark.parametrize(("rounds", "fault"), [(1, "kill"), (2, "kill"), (1, "stop")])
def test_a_node_lost_mid_generation_changes_no_token(gemma_path: Path, tmp_path: Path, reference, rounds: int,
                                                     fault: str) -> None:
    import primaplug
    from primaplug.head.events import Reformed
    from primaplug.head.launch import LocalNodes

    prompt, tokens, scores = reference
    with LocalNodes(gemma_path, 3, log_dir=tmp_path) as local:
        llm = primaplug.Llama(gemma_path, nodes=local.addresses, scheduler="even", rounds=rounds, timeout_s=1.0,
                              node_threads=1, **LLAMA_KWARGS)
        seen: list = []
        llm.events.subscribe(seen.append)
        victim = local.nodes[1]
        got: list = []
        worker = threading.Thread(target=lambda: got.append(greedy_scores(llm, prompt, STEPS)))
        try:
            worker.start()
            while llm.n_tokens < len(prompt) + 5 and worker.is_alive():
                time.sleep(0.005)
            os.kill(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            worker.join(60)
            assert not worker.is_alive(), "the head hung on a lost node"
            assert got, "the generation failed (see the log above)"
            assert_same(got[0], (tokens, scores))
            (r,) = llm.reforms
            assert r.lost == (victim.name,) and r.epoch == llm.cluster.epoch
            assert [n.name for n in llm.cluster.nodes] == ["node1", "node3"]
            # 18 layers: 6 (k = 1) or 3 (k = 2) a round each before, the lost node's share spread over the others
            assert llm.cluster.node_sizes() == ([9, 9] if rounds == 1 else [5, 4]), llm.cluster.node_sizes()
            assert "rescaled" in r.plan and any(isinstance(e, Reformed) for e in seen)
            assert llm.ring_problem() is None
        finally:
            if fault == "stop":
                os.kill(victim.pid, signal.SIGCONT)
            llm.close()
