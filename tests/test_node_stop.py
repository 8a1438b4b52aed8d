"""Nodes end when they should. A node stops promptly on SIGTERM in every state (idle, loading, computing, waiting for
a successor that is gone, waiting for a head), says so in its log and exits cleanly; and a head's local nodes end
with it however it ends: SIGINT, SIGTERM, SIGKILL or a crash."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.ring_helpers import wait_until

pytestmark = pytest.mark.multiproc

STOPS_WITHIN_S = 30  # a bound on a hang, far above the node's own deadline (STOP_DEADLINE_S), not a timing


class Harness:
    """One node process, a control client as its head, and an inbox as its successor."""

    def __init__(self, gemma_path: Path, log_dir: Path) -> None:
        from primaplug.engine import read_layout
        from primaplug.head import NodeClient
        from primaplug.head.launch import LocalNodes
        from primaplug.transport import ZmqTransport
        from primaplug.wire import ModelIdentity

        self.local = LocalNodes(gemma_path, 1, log_dir=log_dir)
        self.node = self.local.start()[0]
        self.t = ZmqTransport()
        self.client = NodeClient(self.t, self.node.address)
        self.client.hello()
        self.inbox = self.t.ring_in("127.0.0.1", 0)
        self.model = ModelIdentity.of(read_layout(gemma_path), gemma_path.name)

    def load(self, epoch: int, successor: str | None = None, n_batch: int = 32) -> None:
        from primaplug.wire import Assignment, WindowSpec

        self.client.load(Assignment(epoch=epoch, model=self.model, windows=(WindowSpec(0, 18),),
                                    successor=successor or self.inbox.address, n_ctx=2 * n_batch, n_batch=n_batch,
                                    n_ubatch=n_batch, n_threads=1))

    def send(self, epoch: int, n_rows: int) -> None:
        """A prompt of n_rows tokens into the node's window."""
        from primaplug.wire import PROTOCOL_VERSION, Activation, Part, encode_ring

        assert self.client.welcome is not None
        out = self.t.ring_out(self.client.welcome.ring_endpoint)
        msg = Activation(proto=PROTOCOL_VERSION, epoch=epoch, step=1, round=0, parts=(Part(0, 0, n_rows),), width=1,
                         dtype="int32")
        assert out.send(encode_ring(msg, np.arange(2, 2 + n_rows, dtype=np.int32)), 5.0)
        out.close()

    def sigterm(self) -> str:
        """SIGTERM the node; returns its log once it exited cleanly."""
        proc = self.node.proc
        proc.send_signal(signal.SIGTERM)
        proc.wait(STOPS_WITHIN_S)
        log = self.node.log()
        assert proc.returncode == 0, f"the node ended with {proc.returncode}:\n{log[-3000:]}"
        assert "SIGTERM: stopping" in log and re.search(r"node node1 stopped", log), log[-3000:]
        return log

    def close(self) -> None:
        self.inbox.close()
        self.client.close()
        self.t.close()
        self.local.stop()


@pytest.fixture
def harness(gemma_path: Path, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(gemma_path, tmp_path / "logs")
    try:
        yield h
    finally:
        h.close()


def test_idle(harness: Harness) -> None:
    harness.sigterm()


def test_waiting_for_its_head(harness: Harness) -> None:
    harness.load(1)
    wait_until(lambda: harness.client.status().state == "ready", "the windows load")
    harness.sigterm()


def test_computing(harness: Harness) -> None:
    harness.load(1, n_batch=512)
    wait_until(lambda: harness.client.status().state == "ready", "the windows load")
    harness.send(1, 512)  # seconds of compute on one thread
    wait_until(lambda: harness.client.status().activity.startswith("computing"), "the node computes")
    log = harness.sigterm()
    assert "while computing step 1" in log, log[-2000:]


def test_loading(harness: Harness) -> None:
    harness.load(1, n_batch=512)
    wait_until(lambda: harness.client.status().state == "ready", "the windows load")
    harness.send(1, 512)
    wait_until(lambda: harness.client.status().activity.startswith("computing"), "the node computes")
    harness.load(2)  # its loader waits for the compute to end
    assert harness.client.status().state == "loading"
    harness.sigterm()


def test_sending_to_a_successor_that_is_gone(harness: Harness) -> None:
    harness.load(1, successor="tcp://127.0.0.1:9")  # nobody listens there: the send waits out its timeout
    wait_until(lambda: harness.client.status().state == "ready", "the windows load")
    harness.send(1, 4)
    wait_until(lambda: harness.client.status().activity.startswith("sending"), "the node waits on its successor")
    log = harness.sigterm()
    assert "exiting without waiting for it" in log or "did not take step" in log, log[-2000:]


HEAD = """
import signal, sys, time
from primaplug.head.launch import LocalNodes
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as at a terminal (a test runner may ignore it)
with LocalNodes(sys.argv[1], 2, log_dir=sys.argv[2]) as local:
    print(" ".join(str(n.pid) for n in local.nodes), flush=True)
    if sys.argv[3] == "crash":
        import os
        os.abort()
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL", "crash"])
def test_local_nodes_end_with_their_head(gemma_path: Path, tmp_path: Path, how: str) -> None:
    head = subprocess.Popen([sys.executable, "-c", HEAD, str(gemma_path), str(tmp_path), how], stdout=subprocess.PIPE,
                            text=True)
    pids: list[int] = []
    try:
        assert head.stdout is not None
        pids += [int(p) for p in head.stdout.readline().split()]
        assert len(pids) == 2, "the head did not start its nodes"
        nodes = [psutil.Process(p) for p in pids]
        if how != "crash":
            head.send_signal(getattr(signal, how))
        head.wait(STOPS_WITHIN_S)
        gone, alive = psutil.wait_procs(nodes, timeout=STOPS_WITHIN_S)
        assert not alive, f"{len(alive)} node(s) outlived a head ended by {how}"
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
        _kill(pids)


def test_run_stopped_by_sigterm_leaves_no_node(tmp_path: Path) -> None:
    """The README's command, its head ended by SIGTERM mid-generation: it stops its nodes and says so."""
    run = subprocess.Popen([sys.executable, "-m", "primaplug", "run", "--local-nodes", "2", "--scheduler", "even",
                            "-n", "3000", "-c", "4096", "--node-threads", "1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert run.stderr is not None
    lines: list[str] = []
    pids: list[int] = []
    for line in run.stderr:
        lines.append(line)
        pids += [int(p) for p in re.findall(r"\(pid (\d+)\)", line)] if "started 2 local nodes" in line else []
        if "deployed in" in line:
            break
    assert len(pids) == 2, "".join(lines)
    time.sleep(1.0)  # generating
    run.send_signal(signal.SIGTERM)
    rest = run.communicate(timeout=STOPS_WITHIN_S)[1]
    try:
        assert run.returncode == 143, "".join(lines) + rest
        assert "stopped the 2 local nodes" in rest and "terminated" in rest, rest
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    finally:
        _kill(pids)


def _kill(pids: list[int]) -> None:
    """What a failed test left running."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
