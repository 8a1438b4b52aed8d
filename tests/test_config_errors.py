"""Set-up mistakes end in a clear error that names the cause: a missing model or key file, a busy port, a split
that does not fit the model. (Wire errors, wrong models and vanished nodes: tests/test_ring_faults.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from primaplug.core import ConfigError


def test_node_without_its_model_file_says_so(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "primaplug", "node", "--model", str(tmp_path / "missing.gguf"),
                        "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing.gguf does not exist" in r.stderr


def test_key_files_that_are_missing_or_wrong_are_named(tmp_path: Path) -> None:
    from primaplug.transport import load_keys

    with pytest.raises(ConfigError, match="no key file at .*nokey.*primaplug keygen"):
        load_keys(tmp_path / "nokey")
    bad = tmp_path / "bad.key"
    bad.write_text('public = "short"\nsecret = "short"\n')
    with pytest.raises(ConfigError, match="40-character"):
        load_keys(bad)


def test_a_busy_port_is_named() -> None:
    from primaplug.transport import ZmqTransport

    t = ZmqTransport()
    try:
        server = t.control_server("127.0.0.1", 0)
        port = int(server.address.rsplit(":", 1)[1])
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            t.ring_in("127.0.0.1", port)
        server.close()
    finally:
        t.close()


@pytest.mark.parametrize(("layers", "rounds", "match"), [
    ((6, 6), 1, "one window size per node"),
    ((6, 6, 5), 1, "cover 17 layers, the model has 18"),
    (None, 4, "the rounds must divide the model's 18 layers, got 4"),
])
def test_a_split_that_does_not_fit_the_model_is_refused(layers, rounds: int, match: str) -> None:
    from primaplug.core import PrimaplugError
    from primaplug.head import Cluster, ClusterSettings
    from primaplug.transport import ZmqTransport
    from primaplug.wire import ModelIdentity

    t = ZmqTransport()
    ident = ModelIdentity(identity="1:x", file_name="m.gguf", n_layer=18, n_embd=640)
    cluster = Cluster(t, ClusterSettings(nodes=("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"), layers=layers,
                                         rounds=rounds), ident)
    try:
        with pytest.raises(PrimaplugError, match=match):
            cluster.plan()
    finally:
        cluster.close()
        t.close()


def test_nodes_off_this_machine_need_keys_and_a_reachable_head(tmp_path: Path) -> None:
    from primaplug.head import Cluster, ClusterSettings
    from primaplug.transport import ZmqTransport, generate_keys
    from primaplug.wire import ModelIdentity

    ident = ModelIdentity(identity="1:x", file_name="m.gguf", n_layer=18, n_embd=640)
    remote = ClusterSettings(nodes=("192.0.2.7:7000",))
    for keys, match in ((None, "need the cluster key"), (generate_keys(tmp_path / "c.key"), "pass --listen")):
        t = ZmqTransport(keys)
        try:
            with pytest.raises(ConfigError, match=match):
                Cluster(t, remote, ident)
        finally:
            t.close()


def test_the_head_refuses_an_open_listen_without_keys(tmp_path: Path) -> None:
    """As nodes do: a head told to receive the ring off loopback without the cluster key refuses before it binds."""
    from primaplug.head import Cluster, ClusterSettings
    from primaplug.transport import ZmqTransport, generate_keys
    from primaplug.wire import ModelIdentity

    ident = ModelIdentity(identity="1:x", file_name="m.gguf", n_layer=18, n_embd=640)
    settings = ClusterSettings(nodes=("127.0.0.1:7000",), listen="0.0.0.0")
    t = ZmqTransport()
    try:
        with pytest.raises(ConfigError, match="refusing to listen on 0.0.0.0 without encryption"):
            Cluster(t, settings, ident)
    finally:
        t.close()
    t = ZmqTransport(generate_keys(tmp_path / "c.key"))
    try:
        Cluster(t, settings, ident).close()  # with the key it binds
    finally:
        t.close()


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"n_parallel": 0}, "n_parallel (--parallel) is the number of requests in flight: 1 to 256, got 0"),
    ({"n_parallel": 300}, "1 to 256, got 300"),
    ({"n_parallel": 2, "draft_model": "prompt-lookup"}, "use n_parallel 1 (--parallel 1) with a draft"),
    ({"ring_trips": -1}, "ring_trips must be 0 (one per device) or more, got -1"),
])
def test_settings_for_requests_in_flight_are_checked_before_anything_loads(kwargs: dict, says: str) -> None:
    import primaplug

    with pytest.raises(ConfigError, match=re.escape(says)):
        primaplug.Llama("no-such-model.gguf", **kwargs)


def test_more_sequences_than_a_batch_holds_is_refused(gemma_path) -> None:
    import primaplug

    with pytest.raises(ConfigError, match=re.escape("n_parallel (8) cannot exceed n_batch (4)")):
        primaplug.Llama(gemma_path, n_parallel=8, n_batch=4, n_ubatch=4)
