"""InprocTransport: ZeroMQ's semantics without sockets. A contract run against both transports shows they agree;
the inproc-only tests pin down what ZeroMQ does implicitly (waiting for a server, the high-water mark, copies)."""

from __future__ import annotations

import ast
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from primaplug.core.errors import ConfigError
from primaplug.transport import (
    ControlClient,
    ControlServer,
    InprocNetwork,
    InprocTransport,
    RingIn,
    RingOut,
    Transport,
)
from primaplug.transport.inproc import RING_HWM

HOST = "127.0.0.1"


@pytest.fixture
def net() -> InprocNetwork:
    return InprocNetwork()


@pytest.fixture
def t(net: InprocNetwork) -> Iterator[InprocTransport]:
    tr = InprocTransport(net)
    yield tr
    tr.close()


# --- the contract: ZmqTransport and InprocTransport behave alike ------------------------------------------


@pytest.fixture(params=["zmq", "inproc"])
def any_transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    if request.param == "zmq":
        pytest.importorskip("zmq")
        from primaplug.transport import ZmqTransport

        tr: Transport = ZmqTransport()
    else:
        tr = InprocTransport(InprocNetwork())
    yield tr
    tr.close()


def test_contract_sockets_satisfy_the_protocols(any_transport: Transport) -> None:
    assert isinstance(any_transport, Transport)
    server = any_transport.control_server(HOST, 0)
    rin = any_transport.ring_in(HOST, 0)
    assert isinstance(server, ControlServer) and isinstance(rin, RingIn)
    assert isinstance(any_transport.control_client(server.address), ControlClient)
    assert isinstance(any_transport.ring_out(rin.address), RingOut)


def test_contract_port_zero_binds_a_real_port(any_transport: Transport) -> None:
    a = any_transport.ring_in(HOST, 0)
    b = any_transport.control_server(HOST, 0)
    for sock in (a, b):
        assert sock.address.startswith(f"tcp://{HOST}:")
        assert int(sock.address.rsplit(":", 1)[1]) > 0
    assert a.address != b.address


def test_contract_binding_a_bound_port_is_a_config_error(any_transport: Transport) -> None:
    rin = any_transport.ring_in(HOST, 0)  # kept: a pyzmq socket that is garbage-collected closes its port
    port = int(rin.address.rsplit(":", 1)[1])
    with pytest.raises(ConfigError, match=f"cannot listen on {HOST}:{port}"):
        any_transport.ring_in(HOST, port)
    with pytest.raises(ConfigError, match=f"cannot listen on {HOST}:{port}"):
        any_transport.control_server(HOST, port)


def test_contract_request_reply_and_a_late_reply_is_never_taken_for_the_next(any_transport: Transport) -> None:
    server = any_transport.control_server(HOST, 0)
    client = any_transport.control_client(server.address)
    first = client.send(b"first")
    got = server.recv(5)
    assert got is not None and got[1] == b"first"
    assert client.take_reply(first, 0.05) is None  # not answered yet: times out
    server.reply(got[0], b"late answer to first")
    second = client.send(b"second")
    got2 = server.recv(5)
    assert got2 is not None and got2[1] == b"second"
    server.reply(got2[0], b"answer to second")
    assert client.take_reply(second, 5) == b"answer to second"  # the late reply was dropped on the way
    assert server.recv(0) is None


def test_contract_ring_delivers_frames_in_order(any_transport: Transport) -> None:
    rin = any_transport.ring_in(HOST, 0)
    out = any_transport.ring_out(rin.address)
    for i in range(5):
        assert out.send([b"header %d" % i, memoryview(bytes([i]) * 3)], 5)
    for i in range(5):
        frames = rin.recv(5)
        assert frames is not None
        assert [bytes(f) for f in frames] == [b"header %d" % i, bytes([i]) * 3]
    assert rin.recv(0.01) is None


def test_contract_ring_send_to_a_closed_input_fails(any_transport: Transport) -> None:
    rin = any_transport.ring_in(HOST, 0)
    out = any_transport.ring_out(rin.address)
    assert out.send([b"hello"], 5)
    assert rin.recv(5) is not None
    rin.close()
    # ZeroMQ learns of the disconnection asynchronously (until then sends fill its queue), so give it time
    deadline = time.monotonic() + 3
    while out.send([b"anyone?"], 0.05):
        assert time.monotonic() < deadline, "sends to a closed ring input kept succeeding"
        time.sleep(0.01)


def test_contract_ring_send_to_nobody_fails_after_its_timeout(any_transport: Transport) -> None:
    with socket.socket() as s:  # a port nothing listens on (closing a zmq socket frees its port only later)
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    out = any_transport.ring_out(f"tcp://{HOST}:{port}")
    t0 = time.monotonic()
    assert not out.send([b"x"], 0.1)
    assert time.monotonic() - t0 >= 0.09


# --- control -------------------------------------------------------------------------------------------------


def test_take_reply_times_out_with_none(t: InprocTransport) -> None:
    server = t.control_server(HOST, 0)
    client = t.control_client(server.address)
    t0 = time.monotonic()
    assert client.request(b"anyone?", 0.1) is None
    assert 0.09 <= time.monotonic() - t0 < 1
    assert server.recv(0) is not None  # the request did arrive; nobody answered it


def test_take_reply_drops_older_replies_and_finds_the_matching_one(t: InprocTransport) -> None:
    server = t.control_server(HOST, 0)
    client = t.control_client(server.address)
    rids = [client.send(b"%d" % i) for i in range(3)]
    assert len(set(rids)) == 3
    for _ in rids:
        got = server.recv(1)
        assert got is not None
        server.reply(got[0], b"reply " + got[1])
    assert client.take_reply(rids[2], 1) == b"reply 2"
    assert client.take_reply(rids[0], 0) is None  # dropped while looking for request 2's


def test_replies_go_to_the_client_that_asked(t: InprocTransport) -> None:
    server = t.control_server(HOST, 0)
    a, b = t.control_client(server.address), t.control_client(server.address)
    ra, rb = a.send(b"from a"), b.send(b"from b")
    for _ in range(2):
        got = server.recv(1)
        assert got is not None
        server.reply(got[0], got[1].upper())
    assert a.take_reply(ra, 1) == b"FROM A"
    assert b.take_reply(rb, 1) == b"FROM B"


def test_a_client_may_connect_before_its_server_binds(net: InprocNetwork, t: InprocTransport) -> None:
    client = t.control_client(f"tcp://{HOST}:7000")
    rid = client.send(b"are you there?")
    server_side = InprocTransport(net)  # another "device" on the same network
    answered = threading.Event()

    def serve() -> None:
        server = server_side.control_server(HOST, 7000)
        got = server.recv(2)
        assert got is not None and got[1] == b"are you there?"
        server.reply(got[0], b"yes")
        answered.set()

    th = threading.Thread(target=serve)
    th.start()
    assert client.take_reply(rid, 2) == b"yes"
    th.join()
    assert answered.is_set()
    server_side.close()


def test_a_wildcard_server_is_reached_on_any_host(t: InprocTransport) -> None:
    server = t.control_server("0.0.0.0", 0)
    port = server.address.rsplit(":", 1)[1]
    client = t.control_client(f"tcp://127.0.0.1:{port}")
    rid = client.send(b"hi")
    got = server.recv(1)
    assert got is not None
    server.reply(got[0], b"hello")
    assert client.take_reply(rid, 1) == b"hello"
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
        t.ring_in("127.0.0.1", int(port))


def test_closing_a_server_leaves_requests_unanswered_and_frees_its_port(t: InprocTransport) -> None:
    server = t.control_server(HOST, 0)
    host_port = server.address.removeprefix("tcp://")
    client = t.control_client(server.address)
    client.send(b"unread")
    server.close()
    assert client.request(b"after close", 0.05) is None
    again = t.control_server(HOST, int(host_port.rsplit(":", 1)[1]))  # the port is free again
    got = again.recv(1)
    assert got is not None and got[1] == b"after close"  # the unread request died with the first server


def test_a_reply_to_a_closed_client_is_dropped(t: InprocTransport) -> None:
    server = t.control_server(HOST, 0)
    client = t.control_client(server.address)
    client.send(b"x")
    got = server.recv(1)
    assert got is not None
    client.close()
    server.reply(got[0], b"nobody listens")  # no error, as with a ROUTER


# --- ring ----------------------------------------------------------------------------------------------------


def test_ring_send_to_nobody_returns_false_and_queues_nothing(t: InprocTransport) -> None:
    out = t.ring_out(f"tcp://{HOST}:7001")
    assert not out.send([b"lost?"], 0.05)
    rin = t.ring_in(HOST, 7001)
    assert rin.recv(0.05) is None  # nothing was kept for a peer that was not there (zmq's `immediate`)


def test_ring_send_waits_for_a_receiver_that_binds_within_its_timeout(net: InprocNetwork,
                                                                      t: InprocTransport) -> None:
    out = t.ring_out(f"tcp://{HOST}:7002")
    later = InprocTransport(net)
    timer = threading.Timer(0.05, lambda: later.ring_in(HOST, 7002))
    timer.start()
    assert out.send([b"late binder"], 2)
    timer.join()
    later.close()


def test_a_full_ring_input_makes_sends_fail_after_their_timeout(t: InprocTransport) -> None:
    rin = t.ring_in(HOST, 0)
    out = t.ring_out(rin.address)
    for i in range(RING_HWM):
        assert out.send([b"%d" % i], 0)
    t0 = time.monotonic()
    assert not out.send([b"one too many"], 0.1)
    assert time.monotonic() - t0 >= 0.09
    assert rin.recv(0) == [b"0"]
    assert out.send([b"room again"], 0)


def test_a_send_waiting_on_a_full_input_goes_once_there_is_room(t: InprocTransport) -> None:
    rin = t.ring_in(HOST, 0)
    out = t.ring_out(rin.address)
    for i in range(RING_HWM):
        assert out.send([b"%d" % i], 0)
    timer = threading.Timer(0.05, lambda: rin.recv(0))
    timer.start()
    assert out.send([b"waited"], 2)
    timer.join()


def test_received_frames_are_copies(t: InprocTransport) -> None:
    rin = t.ring_in(HOST, 0)
    out = t.ring_out(rin.address)
    buf = bytearray(b"original")
    assert out.send([b"h", memoryview(buf)], 1)
    buf[:] = b"changed!"  # the sender reuses its buffer once send returns
    assert rin.recv(1) == [b"h", b"original"]


def test_closing_a_ring_input_loses_what_it_held_and_unregisters_it(t: InprocTransport) -> None:
    rin = t.ring_in(HOST, 0)
    out = t.ring_out(rin.address)
    assert out.send([b"unread"], 0)
    rin.close()
    assert not out.send([b"after close"], 0.02)
    again = t.ring_in(HOST, int(rin.address.rsplit(":", 1)[1]))
    assert again.recv(0.02) is None


def test_a_blocked_recv_returns_none_when_its_socket_is_closed(t: InprocTransport) -> None:
    rin = t.ring_in(HOST, 0)
    timer = threading.Timer(0.05, rin.close)
    timer.start()
    t0 = time.monotonic()
    assert rin.recv(5) is None
    assert time.monotonic() - t0 < 2
    timer.join()


# --- networks and transports -------------------------------------------------------------------------------


def test_networks_are_separate() -> None:
    a, b = InprocTransport(InprocNetwork()), InprocTransport(InprocNetwork())
    rin = a.ring_in(HOST, 7003)
    assert not b.ring_out(rin.address).send([b"x"], 0.02)
    b.ring_in(HOST, 7003)  # the same port is free on another network
    assert a.ring_out(rin.address).send([b"x"], 0.02)


def test_port_zero_gives_fresh_ports(t: InprocTransport) -> None:
    addresses = {t.ring_in(HOST, 0).address for _ in range(5)} | {t.control_server(HOST, 0).address}
    assert len(addresses) == 6


def test_closing_a_transport_closes_its_sockets(net: InprocNetwork) -> None:
    owner, other = InprocTransport(net), InprocTransport(net)
    rin = owner.ring_in(HOST, 0)
    out = other.ring_out(rin.address)
    owner.close()
    assert not out.send([b"x"], 0.02)
    with pytest.raises(RuntimeError):
        owner.ring_in(HOST, 0)
    with pytest.raises(RuntimeError):
        rin.recv(0)


def test_keys_are_kept_for_callers_that_check_them(net: InprocNetwork) -> None:
    from primaplug.transport import ClusterKeys

    keys = ClusterKeys(b"p" * 40, b"s" * 40)
    assert InprocTransport(net, keys).keys is keys
    assert InprocTransport(net).keys is None


def test_the_inproc_side_of_the_package_does_not_import_zmq() -> None:
    """What keeps `import primaplug.transport; InprocTransport` free of zmq: no module but sockets.py and its key
    check (zap.py) imports it (or them) at module level; keys.py imports zmq inside its functions."""
    package = Path(__file__).resolve().parents[1] / "primaplug" / "transport"
    for path in package.glob("*.py"):
        if path.name in ("sockets.py", "zap.py"):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] != "zmq" and name not in ("primaplug.transport.sockets",
                                                                    "primaplug.transport.zap"), \
                    f"{path.name} imports {name} at module level"


def test_localhost_reaches_a_loopback_bind(t: InprocTransport) -> None:
    rin = t.ring_in(HOST, 0)
    port = rin.address.rsplit(":", 1)[1]
    assert t.ring_out(f"tcp://localhost:{port}").send([b"x"], 0.1)
    assert rin.recv(0.1) == [b"x"]
