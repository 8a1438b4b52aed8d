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


SMAPS = """\
55d0c0000000-55d0c0100000 rw-p 00000000 00:00 0                          [heap]
Rss:                1024 kB
Anonymous:          1024 kB
7f0000000000-7f0000400000 rw-p 00000000 00:00 0 
Rss:                3072 kB
Anonymous:          3072 kB
7f0000400000-7f0000500000 r-xp 00000000 fe:01 123                        /usr/lib/libllama.so
Rss:                 512 kB
Anonymous:             0 kB
7f0000500000-7f0000510000 rw-p 00100000 fe:01 123                        /usr/lib/libllama.so
Rss:                  64 kB
Anonymous:            32 kB
7f0000600000-7f0000700000 rw-p 00000000 00:00 0                          [stack]
Rss:                  16 kB
Anonymous:            16 kB
"""


def test_a_node_s_anonymous_memory_is_told_apart_by_where_it_lives() -> None:
    from benchmarks.testbed.memwatch import anon_by_mapping

    out = anon_by_mapping(SMAPS)
    assert out["heap"] == 1.0 and out["anonymous mappings"] == 3.0
    assert out["libraries"] == round(32 / 1024, 2) and out["other"] == round(16 / 1024, 2)
    assert out["largest anonymous mappings (resident MiB / size MiB)"] == ["3.0 / 4.0"]


@pytest.mark.parametrize("v1", [True, False])
def test_a_cgroup_s_memory_splits_into_anonymous_kernel_and_page_cache(tmp_path: Path, v1: bool) -> None:
    from benchmarks.testbed.memwatch import growth, sample_group

    mib = 1 << 20
    if v1:
        (tmp_path / "memory.usage_in_bytes").write_text(str(100 * mib))
        (tmp_path / "memory.kmem.usage_in_bytes").write_text(str(2 * mib))
        (tmp_path / "memory.stat").write_text(f"cache {mib}\ntotal_rss {40 * mib}\ntotal_active_file {50 * mib}\n"
                                              f"total_inactive_file {8 * mib}\ntotal_shmem 0\n")
    else:
        (tmp_path / "memory.current").write_text(str(100 * mib))
        (tmp_path / "memory.stat").write_text(f"anon {40 * mib}\nactive_file {50 * mib}\ninactive_file {8 * mib}\n"
                                              f"kernel {2 * mib}\nshmem 0\n")
    s = sample_group(tmp_path)
    assert s == {"usage": 100 * mib, "anon": 40 * mib, "file": 58 * mib, "kernel": 2 * mib, "shmem": 0}
    marks = [{"used": 30.0, "anon": 28.0, "kernel": 1.0, "shmem": 0.0},
             {"used": 42.0, "anon": 39.0, "kernel": 2.0, "shmem": 0.0}]
    g = growth({"marks": marks, "peak_used_mib": 45.0}, 200 * mib)
    assert g == {"used": 0.06, "anon": 0.055, "kernel": 0.005, "shmem": 0.0, "peak_used_over_start": 0.075}


def test_a_draft_cut_from_a_target_whose_later_layers_add_nothing_gives_its_logits(tmp_path: Path) -> None:
    """benchmarks/speculative_streaming.py's draft: a synthetic target written with its layers from the second on
    scaled by deep_scale, and its first layer with the output layer copied as they are. At deep_scale 0 those
    layers add exactly nothing to the residual stream, so the draft's logits are the target's to the bit; at 1 (the
    plain writer) they are not, and with noise on its output layer the draft's differ too."""
    import numpy as np

    from benchmarks.drafts import truncated_draft
    from primaplug.engine.reference import plain_llama
    from primaplug.engine.synthetic import SyntheticSpec, write_synthetic_gguf

    def logits(path: Path) -> np.ndarray:
        with plain_llama(path, n_ctx=64, n_threads=1, logits_all=True, verbose=False) as llm:
            llm.eval([3 + 7 * i for i in range(12)])
            return np.array(llm.scores[: llm.n_tokens])

    def spec(deep: float) -> SyntheticSpec:
        return SyntheticSpec(arch="llama", n_layer=4, shallow_layers=1, deep_scale=deep, seed=4)

    flat = write_synthetic_gguf(tmp_path / "flat.gguf", spec(0.0))
    full = write_synthetic_gguf(tmp_path / "full.gguf", spec(1.0))
    target = logits(flat)
    assert np.array_equal(logits(truncated_draft(flat, 1, folder=tmp_path)), target)
    assert not np.allclose(logits(truncated_draft(full, 1, folder=tmp_path)), logits(full), atol=1e-2)
    assert not np.allclose(logits(truncated_draft(flat, 1, noise=0.5, folder=tmp_path)), target, atol=1e-2)
