"""The emulated cluster's parts that need no root: the link proxy, device files and presets, the disk lookup."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from benchmarks.testbed import cgroups
from benchmarks.testbed.devices import PAPER_D1_D4, RUNTIME_MIB, load_devices, scaled
from benchmarks.testbed.linkproxy import LinkProxy


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_the_link_proxy_forwards_every_byte_both_ways_and_never_early() -> None:
    srv, port = _echo_server()
    proxy = LinkProxy()
    try:
        endpoint = proxy.route(f"tcp://127.0.0.1:{port}", latency_ms=20, mbit=100)
        host, p = endpoint.removeprefix("tcp://").rsplit(":", 1)
        payload = bytes(range(256)) * 4096  # 1 MiB
        with socket.create_connection((host, int(p))) as s:
            t0 = time.perf_counter()
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = s.recv(1 << 20)
                assert chunk, "the proxy closed the link early"
                got += chunk
            elapsed = time.perf_counter() - t0
        assert got == payload
        # a lower bound the emulation guarantees: two trips of 20 ms, and 1 MiB each way at 100 Mbit/s
        assert elapsed >= 2 * 0.020 + len(payload) * 8 / 100e6
    finally:
        proxy.close()
        srv.close()
    assert proxy.proc.poll() is not None, "the proxy process must exit on close"


def test_presets_scale_memory_and_disk_by_one_factor() -> None:
    d1 = load_devices("paper-d1-d4/24")[0]
    assert d1.name == "d1-mac" and d1.memory_mib == pytest.approx(2.4 * 1024 / 24)
    assert d1.disk_mbps == pytest.approx(700 / 24) and d1.link_latency_ms == PAPER_D1_D4[0].link_latency_ms
    assert d1.cap_bytes == int((d1.memory_mib + RUNTIME_MIB) * (1 << 20))
    assert [d.cpus for d in load_devices("paper-d1-d4-cpu")] == [1.0, 1.5, 2.0, 0.5]
    assert scaled(PAPER_D1_D4, 1) == list(PAPER_D1_D4)


def test_device_files(tmp_path: Path) -> None:
    good = tmp_path / "home.toml"
    good.write_text('[[device]]\nname = "phone"\nmemory_mib = 80\ndisk_mbps = 50\nlink_latency_ms = 6\n'
                    '[[device]]\nname = "laptop"\nmemory_mib = 300\ndisk_mbps = 400\ncpus = 1.5\n')
    phone, laptop = load_devices(str(good))
    assert (phone.name, phone.read_bps, phone.link_latency_ms, phone.cpus) == ("phone", 50_000_000, 6, None)
    assert laptop.cpus == 1.5
    bad = tmp_path / "bad.toml"
    bad.write_text('[[device]]\nname = "x"\n')
    with pytest.raises(SystemExit, match="memory_mib and disk_mbps"):
        load_devices(str(bad))
    with pytest.raises(SystemExit, match="no device file"):
        load_devices(str(tmp_path / "missing.toml"))


def test_the_disk_of_a_file_is_named_as_maj_min(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"x")
    try:
        dev = cgroups.block_device(f)
    except cgroups.CgroupUnavailableError as e:
        pytest.skip(f"{tmp_path} is not on a block device here: {e}")
    major, minor = dev.split(":")
    assert major.isdigit() and minor.isdigit()
    assert (Path("/sys/dev/block") / dev).exists()
