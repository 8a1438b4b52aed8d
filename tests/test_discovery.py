"""Discovery: what an announcement holds (no secret), which nodes a head keeps (same cluster, proven by a Hello
over CurveZMQ), and real `primaplug node --advertise` processes found on loopback, a node with another key, a
spoofed announcement and a node without keys refused, `--nodes auto` and the dashboard adding what it finds.

mDNS runs on the loopback interface (multicast with IP_MULTICAST_IF 127.0.0.1, which Linux delivers even when lo
lacks the MULTICAST flag); where loopback multicast does not work the network tests skip and say so. Every node
and key is made here, and every assertion names them, so other nodes advertised on this machine change nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from primaplug.core import PrimaplugError, ProtocolError
from primaplug.discovery import NO_KEY, Found, decode_txt, encode_txt, fingerprint, keep_proven, refusal
from primaplug.transport import ClusterKeys
from primaplug.wire import PROTOCOL_VERSION

KEYS_A = ClusterKeys(public=b"A" * 40, secret=b"a" * 40)
KEYS_B = ClusterKeys(public=b"B" * 40, secret=b"b" * 40)
MODEL = "253113024:1a14527e038860b111543e1e5847c0c6"
FOUND_WITHIN_S = 30.0  # a deadline for what must happen, never a measured time


def found(name: str, *addresses: str, keys: ClusterKeys | None = KEYS_A, proto: int = PROTOCOL_VERSION,
          models: tuple[str, ...] = ("253113024:1a14527e0388",)) -> Found:
    return Found(name=name, addresses=addresses, models=models, fingerprint=fingerprint(keys), proto=proto,
                 ring_port=7001)


# --- the announcement ---------------------------------------------------------------------------------------------

def test_an_announcement_round_trips_and_holds_no_secret() -> None:
    txt = encode_txt("phone", 7001, [MODEL], KEYS_A)
    as_received = {k.encode(): v.encode() for k, v in txt.items()}  # zeroconf hands bytes
    f = decode_txt("phone-7000._primaplug._tcp.local.", ["192.168.1.20:7000"], as_received)
    assert (f.name, f.address, f.ring_port, f.proto) == ("phone", "192.168.1.20:7000", 7001, PROTOCOL_VERSION)
    assert f.fingerprint == fingerprint(KEYS_A) != fingerprint(KEYS_B) and f.holds(MODEL)
    assert not f.holds("253113024:ffffffffffff")
    text = "".join(txt.values())
    assert KEYS_A.secret.decode() not in text and KEYS_A.public.decode() not in text
    assert encode_txt("phone", 7001, [MODEL], None)["key"] == NO_KEY


def test_every_txt_value_fits_and_long_lists_are_cut() -> None:
    models = [f"{1000 + i}:{i:02x}{'f' * 30}" for i in range(40)]
    txt = encode_txt("n" * 400, 7001, models, KEYS_A)
    assert all(len(f"{k}={v}".encode()) <= 255 for k, v in txt.items())
    kept = txt["models"].split(",")
    assert 0 < len(kept) < len(models) and kept == [m[:len(m) - 20] for m in models[:len(kept)]]


@pytest.mark.parametrize("props", [{}, {b"name": b"x", b"ring": b"1", b"key": b"none"},
                                   {b"proto": b"one", b"name": b"x", b"ring": b"1", b"key": b"none"}])
def test_what_is_not_a_primaplug_announcement_is_refused(props: dict[bytes, bytes]) -> None:
    with pytest.raises(ProtocolError, match="not a primaplug node|malformed"):
        decode_txt("other._primaplug._tcp.local.", ["10.0.0.1:7000"], props)


# --- which nodes a head keeps ---------------------------------------------------------------------------------------

def test_only_nodes_of_the_same_cluster_are_candidates() -> None:
    assert refusal(found("a", "192.168.1.20:7000"), KEYS_A) == ""
    other = refusal(found("b", "192.168.1.21:7000", keys=KEYS_B), KEYS_A)
    assert other == ("node b (192.168.1.21:7000) advertises another cluster key: start it with the same --keys "
                     "file")
    assert "has no cluster key: start it with the same --keys file" in refusal(
        found("c", "127.0.0.1:7000", keys=None), KEYS_A)
    assert "start the head with the same --keys file" in refusal(found("d", "127.0.0.1:7000"), None)
    assert refusal(found("e", "127.0.0.1:7000", keys=None), None) == ""
    assert "not on this machine's loopback" in refusal(found("f", "192.168.1.22:7000", keys=None), None)
    assert "upgrade the node" in refusal(found("g", "192.168.1.23:7000", proto=PROTOCOL_VERSION - 1), KEYS_A)
    assert "does not hold this model" in refusal(found("h", "192.168.1.24:7000"), KEYS_A, "1:abcdef")
    assert refusal(found("h", "192.168.1.24:7000"), KEYS_A, MODEL) == ""


def test_only_nodes_that_prove_the_key_are_kept_in_a_stable_order() -> None:
    answers = {"192.168.1.20:7000": True, "192.168.1.21:7000": False, "10.0.0.5:7000": False,
               "192.168.1.22:7000": True, "127.0.0.1:7100": True}
    asked: list[str] = []

    def prove(address: str) -> bool:
        asked.append(address)
        return answers[address]

    nodes = [found("zed", "192.168.1.20:7000"), found("liar", "192.168.1.21:7000"),
             found("two-nics", "10.0.0.5:7000", "192.168.1.22:7000"), found("stranger", "127.0.0.1:7100", keys=KEYS_B)]
    kept, skipped = keep_proven(nodes, KEYS_A, prove)
    assert [(f.name, a) for f, a in kept] == [("two-nics", "192.168.1.22:7000"), ("zed", "192.168.1.20:7000")]
    assert {f.name: why for f, why in skipped}.keys() == {"liar", "stranger"}
    assert "did not prove it holds this cluster's key" in dict((f.name, w) for f, w in skipped)["liar"]
    assert "127.0.0.1:7100" not in asked  # another cluster's node is never asked anything

    # no proof at hand: only loopback nodes are used, nothing off loopback is taken on its word
    kept, _ = keep_proven([found("lo", "127.0.0.1:7100"), found("lan", "192.168.1.20:7000")], KEYS_A, None)
    assert [f.name for f, _ in kept] == ["lo"]


def test_none_found_says_what_to_do() -> None:
    from primaplug.cli.common import addresses, none_found

    assert none_found(3, []) == ("no primaplug node advertised itself within 3 s: start nodes with --advertise, or "
                                 "pass --nodes HOST:PORT,...")
    assert "skipped: node b" in none_found(3, ["node b advertises another cluster key"])
    assert addresses("auto") == ["auto"]
    with pytest.raises(argparse.ArgumentTypeError, match="or auto"):
        addresses("auto,10.0.0.1:7000")


# --- real nodes on loopback ---------------------------------------------------------------------------------------

def loopback_multicast() -> str:
    """'' when a multicast datagram sent out on loopback comes back, else why not."""
    group = "224.0.0.251"
    recv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        recv.bind(("", 0))
        recv.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton(group) + socket.inet_aton("127.0.0.1"))
        send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        send.sendto(b"primaplug", (group, recv.getsockname()[1]))
        recv.settimeout(2.0)
        recv.recv(64)
        return ""
    except OSError as e:
        return f"multicast on the loopback interface does not work here ({e}): mDNS discovery cannot be tested"
    finally:
        recv.close()
        send.close()


def wait_for(what: str, done: Callable[[], bool], timeout_s: float = FOUND_WITHIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def advertised(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Four advertised nodes: alpha and beta with key A, gamma with key B, delta without keys."""
    why = loopback_multicast()
    if why:
        pytest.skip(why)
    from primaplug.head.launch import LocalNodes
    from primaplug.transport import generate_keys

    tmp = tmp_path_factory.mktemp("discovery")
    key_a, key_b = tmp / "a.key", tmp / "b.key"
    keys = {"a": generate_keys(key_a), "b": generate_keys(key_b)}
    tag = f"{os.getpid()}"  # names of this run only: other nodes advertised here are told apart
    names = [f"alpha{tag}", f"beta{tag}", f"gamma{tag}", f"delta{tag}"]
    args = [["--keys", str(key_a)], ["--keys", str(key_a)], ["--keys", str(key_b)], []]
    with LocalNodes(gemma_path, 4, log_dir=tmp / "logs", names=names, extra_args=["--advertise"],
                    node_args=args) as local:
        by_name = {n.name.removesuffix(tag): n for n in local.nodes}
        yield {"nodes": by_name, "keys": keys, "key_a": key_a, "local": local}


def browser(keys: ClusterKeys | None, **kw: Any) -> Any:
    from primaplug.cli.common import key_proof
    from primaplug.discovery import Browser
    from primaplug.transport import ZmqTransport

    transport = ZmqTransport(keys)
    b = Browser(keys, prove=key_proof(transport), interfaces=["127.0.0.1"], **kw)
    close = b.close

    def close_both() -> None:
        close()
        transport.close()
    b.close = close_both  # type: ignore[method-assign]
    return b.start()


@pytest.mark.multiproc
def test_advertised_nodes_of_the_cluster_are_found_and_the_others_refused(
        advertised: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    nodes, keys = advertised["nodes"], advertised["keys"]
    alpha, beta, gamma = nodes["alpha"], nodes["beta"], nodes["gamma"]
    changes: list[tuple[str, str]] = []
    caplog.set_level(logging.INFO, logger="primaplug.discovery")
    b = browser(keys["a"], on_change=lambda change, f: changes.append((change, f.name)))
    try:
        wait_for("alpha and beta", lambda: b.addresses() == [alpha.address, beta.address])
        wait_for("gamma's refusal", lambda: any(f.name == gamma.name for f, _ in b.refused()))
        why = dict((f.name, w) for f, w in b.refused())[gamma.name]
        assert why.endswith("advertises another cluster key: start it with the same --keys file")
        assert why in caplog.text
        found = {f.name: f for f in b.nodes()}
        assert found[alpha.name].fingerprint == fingerprint(keys["a"]) != found[gamma.name].fingerprint
        assert found[alpha.name].ring_port == int(alpha.ring.rpartition(":")[2])
        assert ("added", alpha.name) in changes and ("added", beta.name) in changes
        assert "rejected a peer" not in gamma.log()  # gamma was refused by its announcement, never contacted

        beta.proc.terminate()  # a node that stops says goodbye: it leaves the list at once
        wait_for("beta's removal", lambda: b.addresses() == [alpha.address])
        assert ("removed", beta.name) in changes
    finally:
        b.close()


@pytest.mark.multiproc
def test_a_spoofed_announcement_is_never_used(advertised: dict[str, Any]) -> None:
    """An announcement with this cluster's fingerprint for a node that holds another key: the Hello over CurveZMQ
    gets no answer, so the head never uses it (and sends it nothing but that Hello)."""
    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    from primaplug.discovery import SERVICE_TYPE

    nodes, keys = advertised["nodes"], advertised["keys"]
    gamma = nodes["gamma"]
    port = int(gamma.address.rpartition(":")[2])
    name = f"impostor{os.getpid()}"
    info = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port, server=f"{name}.local.",
                       properties=encode_txt(name, port + 1, [], keys["a"]), addresses=[socket.inet_aton("127.0.0.1")])
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    b = browser(keys["a"])
    try:
        zc.register_service(info)
        wait_for("the impostor's refusal", lambda: any(f.name == name for f, _ in b.refused()))
        why = dict((f.name, w) for f, w in b.refused())[name]
        assert "did not prove it holds this cluster's key" in why
        assert gamma.address not in b.addresses()
        wait_for("gamma's log of the refused handshake", lambda: "rejected a peer" in gamma.log(), 10)
    finally:
        b.close()
        zc.close()


@pytest.mark.multiproc
def test_nodes_auto_and_a_head_without_keys(advertised: dict[str, Any]) -> None:
    from primaplug.cli.common import discovered

    nodes, key_a = advertised["nodes"], advertised["key_a"]
    alpha, delta = nodes["alpha"], nodes["delta"]
    args = argparse.Namespace(keys=str(key_a))
    gemma = advertised["local"].model
    with discovered(args, gemma) as b:  # as `--nodes auto` does, for DISCOVER_S
        wait_for("alpha", lambda: alpha.address in b.addresses())
        assert delta.address not in b.addresses() and all(a.startswith("127.0.0.1:") for a in b.addresses())

    with tempfile.TemporaryDirectory() as tmp:  # a cluster of its own: the nodes here are all another's
        from primaplug.transport import generate_keys

        generate_keys(Path(tmp) / "c.key")
        stranger = argparse.Namespace(keys=str(Path(tmp) / "c.key"))
        with (pytest.raises(PrimaplugError, match=r"advertised itself within 0\.5 s.*--nodes HOST:PORT"),
              discovered(stranger, gemma, timeout_s=0.5)):
            pass

    b = browser(None)  # no keys: keyless nodes on loopback only
    try:
        wait_for("delta", lambda: delta.address in b.addresses())
        assert alpha.address not in b.addresses()
    finally:
        b.close()


@pytest.mark.multiproc
def test_the_dashboard_adds_the_nodes_it_finds(advertised: dict[str, Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from primaplug.head.coordinator import Coordinator
    from primaplug.tui.app import DashboardApp
    from primaplug.tui.config import Remembered

    monkeypatch.setenv("PRIMAPLUG_CONFIG", str(tmp_path / "config"))
    nodes, key_a = advertised["nodes"], advertised["key_a"]
    alpha = nodes["alpha"]
    b = browser(advertised["keys"]["a"])
    coordinator = Coordinator(advertised["local"].model, [], keys=str(key_a), timeout_s=2.0)
    app = DashboardApp(coordinator, remembered=Remembered(scheduler="even"), blink=False, discovered=b.addresses)
    added = threading.Event()

    async def scenario() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            deadline = time.monotonic() + FOUND_WITHIN_S
            while not (coordinator.entry(alpha.name) is not None and coordinator.choice is not None
                       and not app.busy):
                assert time.monotonic() < deadline, f"the dashboard did not add {alpha.name}; busy: {app.busy!r}"
                await pilot.pause(0.1)
            added.set()
            await pilot.press("q")

    try:
        asyncio.run(scenario())
    finally:
        b.close()
    assert added.is_set() and coordinator.entry(alpha.name).address == alpha.address
    assert alpha.address not in Remembered.load().nodes  # found, not typed in: the next start looks again
