"""benchmarks/peers.py's parts that need no root and no peer: what it reads of each system's output, the files it
writes for distributed-llama, its counters of a device's cgroup, the link proxy's fixed ports, the search's
candidates and the ratios it reports."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import numpy as np
import pytest

from benchmarks.peer_systems import dllama
from benchmarks.peer_systems.base import Outcome, llama_perf, ratio_split, stdout_tpot
from benchmarks.testbed import cgroups
from benchmarks.testbed.linkclient import RemoteLinks
from benchmarks.testbed.linkproxy import LinkProxy

PRIMA_2024 = (  # prima.cpp's rank 0 at exit, as printed (its lines are longer than ours)
    "llama_perf_sampler_print:    sampling time =       0.26 ms /    58 runs   "
    "(    0.00 ms per token, 227450.98 tokens per second)\n"
    "llama_perf_context_print:        load time =      35.77 ms\n"
    "llama_perf_context_print: prompt eval time =     271.71 ms /    26 tokens "
    "(   10.45 ms per token,    95.69 tokens per second)\n"
    "llama_perf_context_print:        eval time =     428.18 ms /    26 runs   "
    "(   16.47 ms per token,    60.72 tokens per second)\n"
    "llama_perf_context_print:       total time =     780.06 ms /    52 tokens\n"
)
LLAMA_2026 = """\
common_perf_print:    sampling time =       1.03 ms
common_perf_print: prompt eval time =     120.50 ms /    17 tokens (    7.09 ms per token,   141.08 tokens per second)
common_perf_print:        eval time =     310.00 ms /    31 runs   (   10.00 ms per token,   100.00 tokens per second)
"""


def test_llama_cpp_s_exit_timings_are_read_in_both_wordings() -> None:
    assert llama_perf(PRIMA_2024) == pytest.approx((0.27171, 0.42818 / 26, 26))
    assert llama_perf(LLAMA_2026) == pytest.approx((0.1205, 0.01, 31))
    assert llama_perf("main: error: unable to load model\n") is None


class _Printed:
    """What a system printed, as Proc keeps it: (time, bytes) pieces."""

    def __init__(self, out: list[tuple[float, bytes]]) -> None:
        self.out = out


def test_tpot_is_first_to_last_printed_token_over_the_steps_between() -> None:
    printed = _Printed([(10.0, b" ab"), (10.1, b" cd"), (10.2, b" ef ab"), (10.5, b" gh\n\n"), (11.0, b"\n")])
    # 5 tokens printed between 10.0 and 10.5 (two arrived in one piece): 4 steps; the late newline is no token
    assert stdout_tpot(printed, 5) == pytest.approx(0.5 / 4)  # type: ignore[arg-type]
    dllama_out = _Printed([(1.0, b"Eval 30 ms Sync 0 ms\n"), (2.0, b"Pred 10 ms ..\n"), (2.3, b"Pred 9 ms ..\n")])
    assert stdout_tpot(dllama_out, 2, lambda c: b"Pred" in c) == pytest.approx(0.3)  # type: ignore[arg-type]
    assert stdout_tpot(_Printed([(1.0, b"x")]), 4) is None  # type: ignore[arg-type]


def test_a_proportional_split_gives_every_layer_and_each_device_its_minimum() -> None:
    assert ratio_split([2.4, 4.1, 9.7, 1.9], 32) == [5, 7, 16, 4]  # one each, the other 28 by weight
    assert sum(ratio_split([1, 1, 1], 16, minimum=0)) == 16
    assert ratio_split([0.0, 1.0], 8, minimum=1) == [1, 7]
    with pytest.raises(ValueError):
        ratio_split([1, 1, 1, 1], 3)
    assert Outcome().status == "ok"


SHAPES = dllama.Shapes(arch="qwen3moe", dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                       head_dim=16, n_experts=4, n_active_experts=2, moe_hidden_dim=32)


def _header(data: bytes) -> tuple[int, dict[int, int]]:
    magic, size = struct.unpack_from("<ii", data)
    pairs = struct.unpack_from(f"<{(size - 8) // 4}i", data, 8)
    return magic, dict(zip(pairs[::2], pairs[1::2], strict=True))


def test_a_distributed_llama_model_holds_every_tensor_its_loader_reads(tmp_path: Path) -> None:
    s = SHAPES
    path = dllama.write_model(s, tmp_path / "m.m")
    data = path.read_bytes()
    magic, header = _header(data)
    assert magic == dllama.MAGIC
    assert header[dllama.KEYS["arch_type"]] == dllama.ARCH["qwen3moe"] and header[dllama.KEYS["n_experts"]] == 4
    assert header[dllama.KEYS["weights_float_type"]] == dllama.Q40 and header[dllama.KEYS["head_dim"]] == 16

    def q40(rows: int, cols: int) -> int:
        return rows * cols // 32 * 18

    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    layer = (q40(q, s.dim) + 2 * q40(kv, s.dim) + q40(s.dim, q) + 4 * s.n_experts * s.dim
             + s.n_experts * (2 * q40(s.moe_hidden_dim, s.dim) + q40(s.dim, s.moe_hidden_dim))
             + 4 * 2 * s.head_dim + 4 * 2 * s.dim)
    tensors = 4 * s.vocab_size * s.dim + s.n_layers * layer + 4 * s.dim + q40(s.vocab_size, s.dim)
    # the loader's own check: the bytes it reads end where the file ends ("Missing bytes in weight file")
    assert len(data) == struct.unpack_from("<i", data, 4)[0] + tensors
    scale = np.frombuffer(data[len(data) - q40(s.vocab_size, s.dim):][:2], dtype=np.float16)[0]
    assert 0 < scale < 0.1


def test_its_tokenizer_holds_the_gguf_s_pieces_with_bytes_as_bytes(tmp_path: Path) -> None:
    from primaplug.engine.synthetic import SyntheticSpec, write_synthetic_gguf

    gguf = write_synthetic_gguf(tmp_path / "m.gguf", SyntheticSpec(n_layer=1, n_vocab=300))
    data = dllama.write_tokenizer(gguf, tmp_path / "m.t").read_bytes()
    magic, header = _header(data)
    assert magic == dllama.TOKENIZER_MAGIC and header[1] == 300 and header[3] == 1  # vocab size, BOS
    at = struct.unpack_from("<i", data, 4)[0] + 4 * header[9]  # past the header and the EOS ids
    pieces = []
    for _ in range(300):
        _score, n = struct.unpack_from("<fI", data, at)
        pieces.append(data[at + 8:at + 8 + n])
        at += 8 + n
    assert at == len(data)
    assert pieces[3 + 0x41] == b"A" and pieces[259] == b" aa"  # <0x41> is the byte A; '\u2581' a space


def test_distributed_llama_s_own_limits_are_said_in_its_words() -> None:
    assert dllama.unsupported(2) is None and dllama.unsupported(4) is None  # too many for the KV heads: it says so
    assert "1, 2, 4, 8" in (dllama.unsupported(3) or "")
    # its root's output where it refuses 4 nodes for a model of 2 KV heads (src/app.cpp), as the harness logs it
    out = ("📄 AddBos: 0\n💡 NKvHeads: 2\n"
           "🚨 Critical error: This version does not support more nodes than the number of KV heads in the model\n")
    assert dllama.refusal(out) == ("unsupported: This version does not support more nodes than the number of KV "
                                   "heads in the model")
    assert dllama.refusal("🔶 Pred  120 ms Sync   40 ms | Sent 1 kB Recv 1 kB | A\n") is None


@pytest.mark.parametrize("v1", [True, False])
def test_a_device_s_disk_reads_cpu_time_and_oom_kills_are_read_off_its_cgroup(tmp_path: Path, v1: bool) -> None:
    g = cgroups.Cgroup("d", cgroups.Caps(1 << 30, 10**8), "254:0", [tmp_path])
    assert g.cpu_seconds() is None  # no controller counts it
    if v1:
        (tmp_path / "cpuacct.usage").write_text("2500000000\n")
        (tmp_path / "memory.limit_in_bytes").write_text("1")
        (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
        (tmp_path / "blkio.throttle.io_service_bytes").write_text(
            "254:0 Read 4096\n254:0 Write 8192\n254:16 Read 77\nTotal 12365\n")
    else:
        (tmp_path / "memory.max").write_text("1")
        (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 3\noom_kill 2\n")
        (tmp_path / "io.stat").write_text("254:16 rbytes=77 wbytes=0\n254:0 rbytes=4096 wbytes=8192 rios=1\n")
        (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert g.read_bytes() == 4096 and g.oom_kills() == 2 and g.cpu_seconds() == 2.5


def test_a_cpu_share_is_enforced_over_a_short_period_with_at_least_a_millisecond_of_quota() -> None:
    assert cgroups.Caps(cpus=0.5).period_us == 100_000  # the testbed's default, as before
    assert cgroups.Caps(cpus=0.5, cpu_period_us=2000).period_us == 2000
    assert cgroups.Caps(cpus=0.08, cpu_period_us=2000).period_us == 12_500  # 1 ms of quota
    assert cgroups.Caps().period_us == 100_000


def test_the_link_proxy_listens_on_a_port_given_and_takes_links_from_another_process() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        fixed = s.getsockname()[1]
    proxy = LinkProxy()
    try:
        assert proxy.route(f"tcp://127.0.0.1:{port}", 1, 100, listen_port=fixed) == f"tcp://127.0.0.1:{fixed}"
        with pytest.raises(RuntimeError, match="did not start a link"):  # that port is the proxy's now
            proxy.route(f"tcp://127.0.0.1:{port}", 1, 100, listen_port=fixed)
        remote = RemoteLinks(proxy.control)
        try:
            ep = remote.route(f"tcp://127.0.0.1:{port}", 1, 100)
            host, p = ep.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(p))):
                conn, _ = srv.accept()
                conn.close()
        finally:
            remote.close()
    finally:
        proxy.close()
        srv.close()


def test_the_search_s_candidates_and_the_ratios_it_reports() -> None:
    from benchmarks.peers import WORKLOADS, candidates, ratios, tokens_match

    devices = WORKLOADS["W1"].devices
    ring = candidates("prima.cpp", devices, 32, 55.0, {"primaplug": "2,20,8,2"})
    assert all(sum(p.split or ()) in (32, 16, 8) for p in ring)
    assert ring[-1].split == (2, 20, 8, 2) and "other ring" in ring[-1].name
    rpc = candidates("llama.cpp-rpc", devices, 32, 55.0, {})
    fit = next(p for p in rpc if p.extra)
    assert sum(fit.split or ()) == 32 and dict(fit.extra)["no_repack"]
    assert all(w * 55.0 <= 0.8 * d.memory_mib for w, d in zip(fit.split[1:], devices[1:], strict=True))  # type: ignore[index]
    d = candidates("distributed-llama", devices, 32, 55.0, {})
    assert [dict(p.extra)["devices"][0] for p in d] == [0, 0, 0]  # its root stays on the head's device

    def row(system: str, tpot: float, ttft: float, pressure: float, status: str = "ok") -> dict:
        return {"system": system, "placement": "own", "devices": 4, "status": status, "tpot_s": tpot,
                "ttft_s": ttft, "max_pressure": pressure, "tokens_match_plain": True}

    r = ratios([row("primaplug", 2.0, 10.0, 0.10), row("prima.cpp", 4.0, 8.0, 0.06),
                row("llama.cpp-rpc", 1.0, 1.0, 0.9, "oom")])
    assert r["tpot_vs_fastest_peer"] == 0.5 and r["ttft_vs_fastest_peer"] == 1.25
    assert r["pressure_points_over_lowest_peer"] == 4.0 and r["fastest_peer"].startswith("prima.cpp")
    assert "nothing to compare" in ratios([row("primaplug", 1, 1, 0)])["note"]
    ref = {"tokens": [5, 6], "text": " ab cd"}
    assert tokens_match({"status": "ok", "token_ids": [5, 6], "text": None}, ref)
    assert tokens_match({"status": "ok", "token_ids": None, "text": " ab cd\n\n"}, ref)
    assert tokens_match({"status": "ok", "token_ids": None, "text": " ab ce"}, ref) is False
    assert tokens_match({"status": "oom", "token_ids": None, "text": None}, ref) is None


def test_what_is_committed_names_no_path_of_this_machine(tmp_path: Path) -> None:
    from benchmarks.peers import ROOT, Peers

    peers = Peers(tmp_path / "prima.cpp", tmp_path / "distributed-llama", None)
    home = Path.home()
    log = tmp_path / "logs" / "W1" / "rank0.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(f"$ {tmp_path}/prima.cpp/llama-cli -m {home}/.cache/m.gguf\n{ROOT}/x.py\n\xff\n".encode("latin-1"))
    peers.scrub_logs(tmp_path / "logs")
    text = log.read_bytes().decode("latin-1")
    assert text == "$ <prima.cpp>/llama-cli -m ~/.cache/m.gguf\n<repo>/x.py\n\xff\n"
    assert peers.scrub(f"--dllama {tmp_path}/distributed-llama") == "--dllama <distributed-llama>"


@pytest.mark.parametrize("answer", ["ring", "server"])
def test_a_step_s_wall_time_splits_into_each_sender_s_time_and_the_links_from_the_proxy_s_traces(
        tmp_path: Path, answer: str) -> None:
    """Two parties through two traced links: `a` passes a message to `b`, which holds it 30 ms and passes it back
    (over a link of its own, as a ring does, or answering on `a`'s, as a server does). Every message crosses at least
    its link's latency; the sleeps bound each party's share from below; the parts add up to the wall time."""
    import time

    from benchmarks.testbed.hops import breakdown

    srv_a, srv_b = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    proxy = LinkProxy(trace_dir=tmp_path)
    try:
        to_b = proxy.route(f"tcp://127.0.0.1:{srv_b.getsockname()[1]}", 20, 1000,
                           sender="a" if answer == "ring" else "a>b")
        a_out = socket.create_connection(tuple(to_b.removeprefix("tcp://").rsplit(":", 1)))  # type: ignore[arg-type]
        b_in = srv_b.accept()[0]
        if answer == "ring":
            to_a = proxy.route(f"tcp://127.0.0.1:{srv_a.getsockname()[1]}", 20, 1000, sender="b")
            b_out = socket.create_connection(tuple(to_a.removeprefix("tcp://").rsplit(":", 1)))  # type: ignore[arg-type]
            a_in = srv_a.accept()[0]
        else:
            b_out, a_in = b_in, a_out
        start = time.monotonic()
        for _ in range(3):
            a_out.sendall(b"x" * 100)
            assert len(b_in.recv(100, socket.MSG_WAITALL)) == 100
            time.sleep(0.03)
            b_out.sendall(b"y" * 100)
            assert len(a_in.recv(100, socket.MSG_WAITALL)) == 100
            end = time.monotonic()
        for s in {a_out, b_out, a_in, b_in}:
            s.close()
    finally:
        proxy.close()
        srv_a.close()
        srv_b.close()
    hops = breakdown(tmp_path, start, end, 3)
    assert hops["messages_per_step"] == 2
    assert set(hops["device_ms"]) == {"a", "b"}
    assert hops["device_ms"]["b"] >= 30
    assert hops["link_ms"] >= 40
    parts = sum(hops["device_ms"].values()) + hops["link_ms"] + hops["proxy_late_ms"]
    assert abs(parts - hops["wall_ms"]) < 1


def test_a_device_s_cpu_time_at_the_last_token_lies_between_the_watch_s_samples_around_it() -> None:
    from benchmarks.testbed.memwatch import MemoryWatch

    watch = MemoryWatch([])
    watch.cpu_series = [(10.0, [1.0, None]), (10.1, [1.2, None]), (10.2, [1.6, None])]
    assert watch.cpu_at(10.15) == [pytest.approx(1.4), None]
    assert watch.cpu_at(10.1) == [pytest.approx(1.2), None]
    assert watch.cpu_at(9.0) == [pytest.approx(1.0), None]  # before the first sample: the first
    assert watch.cpu_at(11.0) == [pytest.approx(1.6), None]  # after the last: the last


def test_primaplug_s_head_process_carries_none_of_the_harness() -> None:
    """The head runs on an emulated device, and all it holds counts in that device's memory pressure: its module
    imports the link proxy's client and primaplug, not the rig, the proxy or their asyncio (2.1 MiB, measured when
    it did)."""
    import subprocess
    import sys

    probe = ("import sys, benchmarks.peer_systems.primaplug_head\n"
             "print(sorted(m for m in sys.modules if m in ('asyncio', 'ssl') or m.startswith('benchmarks.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == ("['benchmarks.peer_systems', 'benchmarks.peer_systems.primaplug_head', "
                                  "'benchmarks.testbed', 'benchmarks.testbed.linkclient']"), out.stdout + out.stderr


def _checkout(path: Path, makefile: str) -> Path:
    """A git checkout holding a Makefile, committed, with a build product and an untracked file beside it."""
    import subprocess

    path.mkdir()
    (path / "Makefile").write_text(makefile)
    (path / "big.bin").write_text("a large tracked file")
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "Makefile", "big.bin"], ["commit", "-qm", "toy"]):
        subprocess.run([*git, *cmd], check=True)
    (path / "prog").write_text("stale: built in the checkout")
    (path / "untracked.txt").write_text("not part of the source")
    (path / "big.bin").unlink()  # a snapshot may lack its largest files, which no build needs
    return path


def test_a_peer_is_built_from_its_checkout_s_tracked_files_once_per_source_and_commands(tmp_path: Path,
                                                                                          capsys) -> None:
    from benchmarks.peer_systems import builds

    src = _checkout(tmp_path / "toy", "prog:\n\tls | grep -vx prog > prog\n")
    cache, log = tmp_path / "cache", tmp_path / "logs" / "toy.log"
    out = builds.cached("toy", builds.checkout(src), [["make", "prog"]], {"prog": "bin/prog"}, cache, log,
                        notes={"x": "y"})
    assert (out / "bin" / "prog").read_text().split() == ["Makefile"]  # a copy: no product, no untracked file
    assert (src / "prog").read_text().startswith("stale")  # the checkout is left as it was
    done = builds.recorded(out)
    commit = builds.source_key(src)[0]
    assert (done["commit"], done["uncommitted"], done["commands"], done["x"]) == (commit, [], [["make", "prog"]], "y")
    assert builds.summary(out) == {"commit": commit, "flags": "make prog"}
    assert "building toy" in capsys.readouterr().err
    assert builds.cached("toy", builds.checkout(src), [["make", "prog"]], {"prog": "bin/prog"}, cache, log) == out
    assert "building toy" not in capsys.readouterr().err  # cached
    (src / "Makefile").write_text("prog:\n\techo changed > prog\n")  # an uncommitted change is another build
    again = builds.cached("toy", builds.checkout(src), [["make", "prog"]], {"prog": "bin/prog"}, cache, log)
    assert again != out and (again / "bin" / "prog").read_text() == "changed\n"
    assert builds.recorded(again)["uncommitted"] == ["Makefile"]
    assert builds.summary(again)["commit"] == f"{commit} with uncommitted changes to 1 file(s)"


def test_a_peer_build_that_fails_keeps_nothing_and_says_where_its_log_is(tmp_path: Path) -> None:
    from benchmarks.peer_systems import builds

    src = _checkout(tmp_path / "toy", "prog:\n\tfalse\n")
    cache, log = tmp_path / "cache", tmp_path / "toy.log"
    with pytest.raises(builds.BuildError, match=rf"building toy failed at `make prog`: see {log}"):
        builds.cached("toy", builds.checkout(src), [["make", "prog"]], {"prog": "prog"}, cache, log)
    assert "$ make prog" in log.read_text() and list(cache.iterdir()) == []
    toy = builds.checkout(src)
    with pytest.raises(builds.BuildError, match="made no lib/libtoy.so"):  # `{out}`: an install prefix
        builds.cached("toy", toy, [["sh", "-c", "mkdir -p {out}/lib"]], {}, cache, log, expect=("lib/libtoy.so",))
    assert list(cache.iterdir()) == []
    out = builds.cached("toy", toy, [["sh", "-c", "mkdir -p {out}/lib && touch {out}/lib/libtoy.so"]], {}, cache, log,
                        expect=("lib/libtoy.so",))
    assert (out / "lib" / "libtoy.so").exists()
    (tmp_path / "plain").mkdir()
    with pytest.raises(builds.BuildError, match="git rev-parse failed in .*not a git repository.*give a clone"):
        builds.cached("toy", builds.checkout(tmp_path / "plain"), [["true"]], {}, cache, log)


def test_prima_cpp_without_highs_asks_for_a_checkout_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.peer_systems import builds, prima_cpp

    monkeypatch.setattr(prima_cpp, "README_PREFIX", tmp_path)  # no HiGHS where prima.cpp's Makefile looks
    assert not prima_cpp.highs_installed()
    with pytest.raises(builds.BuildError, match=r"needs HiGHS.*give --highs DIR"):
        prima_cpp.build(tmp_path / "prima.cpp", None, tmp_path / "cache", tmp_path)


def test_a_peer_without_its_checkout_gets_a_row_that_says_which_flag_gives_it(tmp_path: Path) -> None:
    from benchmarks.peers import Peers

    peers = Peers(None, None, None)
    peers.build(["primaplug", "prima.cpp", "distributed-llama", "exo"], None, tmp_path)
    assert peers.bins == {} and set(peers.errors) == {"prima.cpp", "distributed-llama"}
    assert peers.missing("prima.cpp") == ("no checkout given (--prima-cpp DIR: a clone of Lizonghang/prima.cpp, built "
                                          "here by its README)")
    assert "--dllama DIR" in peers.errors["distributed-llama"] and peers.missing("primaplug") is None
