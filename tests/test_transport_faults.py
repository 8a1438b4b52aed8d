"""FaultyTransport over InprocTransport: each fault fires when and where it is told to, and says so in its log."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from primaplug.transport import FaultyTransport, Frames, InprocNetwork, InprocTransport, Transport
from primaplug.transport.base import ControlServer
from primaplug.transport.faults import flip_last

HOST = "127.0.0.1"


@pytest.fixture
def net() -> InprocNetwork:
    return InprocNetwork()


@pytest.fixture
def faults(net: InprocNetwork) -> Iterator[FaultyTransport]:
    f = FaultyTransport(InprocTransport(net))
    yield f
    f.close()


def first_frame(value: bytes) -> Callable[[Frames], bool]:
    return lambda frames: bytes(frames[0]) == value


class Echo:
    """A control server answering every request with b're: ' + request, in a thread, until stopped."""

    def __init__(self, server: ControlServer) -> None:
        self.server, self.stopping = server, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.is_set():
            got = self.server.recv(0.01)
            if got is not None:
                self.server.reply(got[0], b"re: " + got[1])

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(2)


@pytest.fixture
def echo(faults: FaultyTransport) -> Iterator[Echo]:
    e = Echo(faults.control_server(HOST, 0))
    yield e
    e.stop()


def test_a_faulty_transport_is_a_transport(faults: FaultyTransport) -> None:
    assert isinstance(faults, Transport)
    assert faults.keys is None


def test_without_rules_it_passes_everything_through(faults: FaultyTransport, echo: Echo) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    assert out.send([b"a", b"payload"], 1)
    assert rin.recv(1) == [b"a", b"payload"]
    assert faults.control_client(echo.server.address).request(b"ping", 1) == b"re: ping"
    assert faults.log == []


# --- ring ----------------------------------------------------------------------------------------------------


def test_drop_ring_loses_the_third_message_and_the_sender_cannot_tell(faults: FaultyTransport) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    faults.drop_ring(after=2)
    assert all(out.send([b"%d" % i], 1) for i in range(5))  # every send "succeeds", as over a lossy link
    got = []
    while (frames := rin.recv(0.02)) is not None:
        got.append(bytes(frames[0]))
    assert got == [b"0", b"1", b"3", b"4"]  # a pass-through would have delivered b"2" too
    assert faults.log == [f"drop ring -> {rin.address}"]


def test_drop_ring_targets_the_messages_its_match_picks(faults: FaultyTransport) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    faults.drop_ring(first_frame(b"odd"), count=None)  # every one of them
    for tag in (b"odd", b"even", b"odd", b"even"):
        assert out.send([tag], 1)
    assert rin.recv(0.02) == [b"even"]
    assert rin.recv(0.02) == [b"even"]
    assert rin.recv(0.02) is None
    assert len(faults.log) == 2


def test_a_ring_fault_can_be_aimed_at_one_link(faults: FaultyTransport) -> None:
    a, b = faults.ring_in(HOST, 0), faults.ring_in(HOST, 0)
    faults.drop_ring(address=b.address)
    assert faults.ring_out(a.address).send([b"to a"], 1)
    assert faults.ring_out(b.address).send([b"to b"], 1)
    assert a.recv(0.02) == [b"to a"]
    assert b.recv(0.02) is None
    assert faults.log == [f"drop ring -> {b.address}"]


def test_delay_ring_delivers_late(faults: FaultyTransport) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    faults.delay_ring(0.2)
    received_at: list[float] = []

    def receive() -> None:
        if rin.recv(2) is not None:
            received_at.append(time.monotonic())

    th = threading.Thread(target=receive)
    th.start()
    t0 = time.monotonic()
    assert out.send([b"slow"], 1)
    th.join()
    assert received_at and received_at[0] - t0 >= 0.19
    assert faults.log == [f"delay ring -> {rin.address} (0.2 s)"]
    t1 = time.monotonic()
    assert out.send([b"fast"], 1)  # the rule fired once (count=1)
    assert rin.recv(1) == [b"fast"] and time.monotonic() - t1 < 0.15


def test_corrupt_ring_truncates_the_last_frame_and_leaves_the_senders_buffer_alone(faults: FaultyTransport) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    faults.corrupt_ring()
    rows = bytearray(b"12345678")
    assert out.send([b"header", memoryview(rows)], 1)
    assert rin.recv(1) == [b"header", b"1234567"]
    assert rows == bytearray(b"12345678")
    assert faults.log == [f"corrupt ring -> {rin.address}"]


def test_corrupt_ring_with_flip_last_keeps_sizes_and_changes_contents(faults: FaultyTransport) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    faults.corrupt_ring(first_frame(b"h2"), how=flip_last)
    assert out.send([b"h1", b"\x00\x01"], 1)
    assert out.send([b"h2", b"\x00\x01"], 1)
    assert rin.recv(1) == [b"h1", b"\x00\x01"]
    assert rin.recv(1) == [b"h2", b"\xff\xfe"]
    assert len(faults.log) == 1


# --- control -------------------------------------------------------------------------------------------------


def test_drop_control_loses_a_request(faults: FaultyTransport, echo: Echo) -> None:
    client = faults.control_client(echo.server.address)
    faults.drop_control(lambda body: body == b"status")
    assert client.request(b"hello", 1) == b"re: hello"
    t0 = time.monotonic()
    assert client.request(b"status", 0.1) is None
    assert time.monotonic() - t0 >= 0.09
    assert client.request(b"status", 1) == b"re: status"  # count=1: the next one goes through
    assert faults.log == [f"drop request -> {echo.server.address}"]


def test_a_lost_request_can_be_polled_for_again(faults: FaultyTransport, echo: Echo) -> None:
    client = faults.control_client(echo.server.address)
    faults.drop_control()
    rid = client.send(b"probe")
    assert client.take_reply(rid, 0) is None
    assert client.take_reply(rid, 0) is None
    assert client.request(b"next", 1) == b"re: next"


def test_drop_control_reply_loses_the_answer(faults: FaultyTransport, echo: Echo) -> None:
    client = faults.control_client(echo.server.address)
    faults.drop_control(reply=True)
    assert client.request(b"one", 0.1) is None
    assert client.request(b"two", 1) == b"re: two"
    assert faults.log == [f"drop reply <- {echo.server.address}"]


def test_a_delayed_reply_times_out_and_is_never_taken_for_the_next(faults: FaultyTransport, echo: Echo) -> None:
    client = faults.control_client(echo.server.address)
    faults.delay_control(0.2, reply=True)
    assert client.request(b"slow", 0.05) is None
    time.sleep(0.25)  # the late reply has arrived by now
    assert client.request(b"next", 1) == b"re: next"
    assert faults.log == [f"delay reply <- {echo.server.address} (0.2 s)"]


def test_delay_control_request_arrives_late(faults: FaultyTransport) -> None:
    server = faults.control_server(HOST, 0)
    client = faults.control_client(server.address)
    faults.delay_control(0.15)
    t0 = time.monotonic()
    client.send(b"late")
    got = server.recv(1)
    assert got is not None and got[1] == b"late" and time.monotonic() - t0 >= 0.14
    assert faults.log == [f"delay request -> {server.address} (0.15 s)"]


# --- kill ----------------------------------------------------------------------------------------------------


def test_kill_silences_a_peer_and_loses_what_it_held(net: InprocNetwork, faults: FaultyTransport) -> None:
    control = faults.control_server(HOST, 0)
    ring = faults.ring_in(HOST, 0)
    echo = Echo(control)
    client = faults.control_client(control.address)
    assert client.request(b"alive?", 1) == b"re: alive?"
    out = faults.ring_out(ring.address)
    assert out.send([b"queued before the kill"], 1)

    faults.kill(control.address, ring.address)

    assert client.request(b"alive?", 0.1) is None
    assert ring.recv(0.02) is None  # the queued message died with the peer
    assert not out.send([b"after"], 0.02)
    # a device with a plain transport on the same network sees the peer gone as well
    other = InprocTransport(net)
    assert not other.ring_out(ring.address).send([b"after"], 0.02)
    assert other.control_client(control.address).request(b"alive?", 0.05) is None
    echo.stop()
    other.close()
    assert faults.log[:2] == [f"kill {control.address}", f"kill {ring.address}"]
    assert f"lost request -> {control.address} (killed)" in faults.log
    assert f"refused ring -> {ring.address} (killed)" in faults.log


def test_kill_wakes_a_peer_blocked_in_recv(faults: FaultyTransport) -> None:
    ring = faults.ring_in(HOST, 0)
    result: list[Frames | None] = []
    th = threading.Thread(target=lambda: result.append(ring.recv(5)))
    th.start()
    time.sleep(0.02)
    t0 = time.monotonic()
    faults.kill(ring.address)
    th.join(2)
    assert result == [None] and time.monotonic() - t0 < 1


def test_a_killed_peer_does_not_answer_requests_it_was_handling(faults: FaultyTransport) -> None:
    control = faults.control_server(HOST, 0)
    client = faults.control_client(control.address)
    rid = client.send(b"work")
    got = control.recv(1)
    assert got is not None
    faults.kill(control.address)
    control.reply(got[0], b"done")  # the process is gone: this never leaves
    assert client.take_reply(rid, 0.05) is None


def test_clear_forgets_the_rules_that_have_not_fired(faults: FaultyTransport) -> None:
    rin = faults.ring_in(HOST, 0)
    out = faults.ring_out(rin.address)
    faults.drop_ring(count=None)
    assert out.send([b"lost"], 1)
    faults.clear()
    assert out.send([b"kept"], 1)
    assert rin.recv(1) == [b"kept"]
    assert faults.log == [f"drop ring -> {rin.address}"]
