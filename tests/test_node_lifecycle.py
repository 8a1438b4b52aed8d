"""A real node process over its lifetime: it reads only the model files it opened at start, whatever their names
point at later, and it frees its windows when its head has gone silent for --release-after seconds."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.ring_helpers import LLAMA_KWARGS, greedy_scores, wait_until

pytestmark = pytest.mark.multiproc

SECRET = b"SECRET-BYTES-THE-HEAD-MUST-NEVER-SEE"


def _tokens_through(node_address: str, gemma_path: Path, prompt: bytes) -> list[int]:
    import primaplug

    llm = primaplug.Llama(gemma_path, nodes=[node_address], layers=[9, 9], node_threads=1, **LLAMA_KWARGS)
    try:
        return greedy_scores(llm, llm.tokenize(prompt), 4)[0]
    finally:
        llm.close()


def test_a_node_loads_only_the_file_it_opened_at_start(gemma_path: Path, model_dir: Path, tmp_path: Path) -> None:
    import llama_cpp
    import msgspec

    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.head.launch import LocalNodes
    from primaplug.transport import ZmqTransport
    from primaplug.wire import Assignment, ModelIdentity, WindowSpec
    from tests.conftest import synthetic_path

    link = tmp_path / "model.gguf"
    link.symlink_to(gemma_path)
    small = tmp_path / "small.gguf"  # a copy of its own, written in place below
    shutil.copyfile(synthetic_path(model_dir, "llama", 7, "Q8_0"), small)
    small_layout = read_layout(small)
    text = tmp_path / "notes.txt"
    text.write_bytes(SECRET + b"\n" + b"plain text, not a model\n" * 100)

    plain = llama_cpp.Llama(str(gemma_path), **LLAMA_KWARGS)
    try:
        prompt = b"Files are opened once"
        expected = greedy_scores(plain, plain.tokenize(prompt), 4)[0]
    finally:
        plain.close()

    with LocalNodes(link, 1, log_dir=tmp_path / "logs", extra_args=["--model", str(small)]) as local:
        node = local.nodes[0]
        for target in (text, small):  # the name now points at a text file, then at another GGUF
            link.unlink()
            link.symlink_to(target)
            assert _tokens_through(node.address, gemma_path, prompt) == expected, f"with the link on {target.name}"

        # the held file itself written in place: refused with what changed, never with what it now holds
        with open(small, "r+b") as f:
            f.write(SECRET)
        t = ZmqTransport()
        client = NodeClient(t, node.address)
        try:
            client.hello()
            a = Assignment(epoch=5, model=ModelIdentity.of(small_layout, small.name), windows=(WindowSpec(0, 3),),
                           successor="tcp://127.0.0.1:9", n_ctx=64, n_batch=16, n_ubatch=16, n_threads=1)
            client.load(a)
            wait_until(lambda: client.status().state == "failed", "the load of the rewritten file fails")
            status = client.status()
            assert "was written since this node started" in status.message and "restart" in status.message, status
            assert SECRET.decode() not in msgspec.json.encode(status).decode()
        finally:
            client.close()
            t.close()
        assert SECRET.decode() not in node.log()


def test_a_node_frees_its_windows_when_its_head_goes_silent(gemma_path: Path, tmp_path: Path) -> None:
    import msgspec
    import psutil

    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.head.launch import LocalNodes
    from primaplug.transport import ZmqTransport
    from primaplug.wire import (
        PROTOCOL_VERSION,
        Activation,
        Assignment,
        ModelIdentity,
        Part,
        WindowSpec,
        decode_ring,
        encode_ring,
    )

    release_s = 1.0
    layout = read_layout(gemma_path)
    with LocalNodes(gemma_path, 1, log_dir=tmp_path / "logs", extra_args=["--release-after", str(release_s)]) as local:
        node = local.nodes[0]
        proc = psutil.Process(node.pid)
        t = ZmqTransport()
        client = NodeClient(t, node.address)
        inbox = t.ring_in("127.0.0.1", 0)
        try:
            client.hello()
            a = Assignment(epoch=3, model=ModelIdentity.of(layout, gemma_path.name), windows=(WindowSpec(0, 18),),
                           successor=inbox.address, n_ctx=128, n_batch=32, n_ubatch=32, n_threads=1)
            client.load(a)
            wait_until(lambda: client.status().state == "ready", "the assignment loads")
            out = t.ring_out(client.welcome.ring_endpoint)
            step = 0

            def activation() -> None:
                nonlocal step
                step += 1
                msg = Activation(proto=PROTOCOL_VERSION, epoch=3, step=step, round=0, parts=(Part(0, 0, 4),), width=1,
                                 dtype="int32")
                assert out.send(encode_ring(msg, np.array([2, 10, 20, 30], np.int32)), 5.0)
                got = inbox.recv(10.0)
                assert got is not None and isinstance(decode_ring(got)[0], Activation)

            def keep_talking(say: Callable[[], Any]) -> None:  # several times release_s, a word every quarter of it
                end = time.monotonic() + 2 * release_s
                while time.monotonic() < end:
                    say()
                    time.sleep(release_s / 4)

            activation()
            loaded_rss = proc.memory_info().rss
            keep_talking(client.status)  # the head's heartbeat
            keep_talking(activation)  # or ring traffic alone
            assert client.status().state == "ready", "the node freed its windows while its head was talking to it"

            def released() -> bool:
                time.sleep(2 * release_s)  # silence: any request (this status too) counts as the head's word
                return client.status().state == "idle"

            wait_until(released, "the node frees its windows", timeout_s=30)
            status = client.status()
            assert "freed the windows of assignment 3" in status.message and "without a word from a head" in \
                status.message, status
            freed = (loaded_rss - proc.memory_info().rss) / 2**20
            weights = sum(layout.layer_bytes(il) for il in range(layout.n_layer)) / 2**20
            print(f"freed {freed:.0f} MiB of {loaded_rss / 2**20:.0f}; layers {weights:.0f} MiB")
            assert freed > weights / 2, f"the node's RSS fell by {freed:.0f} MiB; its layers hold {weights:.0f} MiB"
            assert "freed the windows of assignment 3" in node.log()

            client.load(msgspec.structs.replace(a, epoch=4))  # and the next head deploys as to any idle node
            wait_until(lambda: client.status().state == "ready", "the next assignment loads")
            out.close()
        finally:
            inbox.close()
            client.close()
            t.close()


def test_a_local_node_that_dies_is_named_with_its_exit_status_and_its_log(gemma_path: Path) -> None:
    """A node started by the head (--local-nodes) whose process dies: the head's error says so, with how it ended
    (the signal, by name) and where its log is, and that log is kept for the user to read."""
    import argparse
    import os
    import signal

    import psutil

    from primaplug.cli.common import node_addresses
    from primaplug.core.errors import NodeUnavailableError, PrimaplugError

    args = argparse.Namespace(nodes=None, local_nodes=1, local_fetch=False)  # as `run` parses it
    with pytest.raises(PrimaplugError) as caught, node_addresses(args, gemma_path) as addresses:
        assert len(addresses) == 1
        (node,) = [c for c in psutil.Process().children() if "node" in c.cmdline()]
        node.send_signal(signal.SIGSEGV)
        # until its exit status can be read (WNOWAIT: not reaped, which would leave the head nothing to read). Not
        # until it shows as a zombie: a process with threads shows so once its main thread has exited, before the
        # others have and before its parent can read its status (that wait made this test fail once in a full run)
        wait_until(lambda: os.waitid(os.P_PID, node.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None,
                   "the node's exit status can be read", 10)
        raise NodeUnavailableError("node1", "node node1 did not answer GetProfile")
    message = str(caught.value)
    assert "did not answer GetProfile" in message and "was killed by SIGSEGV" in message, message
    log = Path(message.split("its log: ", 1)[1].split()[0])
    assert log.name == "node1.log" and log.exists(), "the log of a node that died is kept"
    shutil.rmtree(log.parent)
