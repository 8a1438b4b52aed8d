"""Planning with real nodes: each node profiles itself over the control channel, the head measures the links over
the ring, the scheduler plans, and the ring it deploys still gives plain llama-cpp-python's tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ring_helpers import LLAMA_KWARGS, assert_same, greedy_scores

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def nodes(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 3, log_dir=tmp_path_factory.mktemp("plan-nodes")) as local:
        yield local


@pytest.fixture(scope="module")
def plain(gemma_path: Path) -> tuple[list[int], object]:
    import llama_cpp

    llm = llama_cpp.Llama(str(gemma_path), **LLAMA_KWARGS)
    try:
        return greedy_scores(llm, list(range(5, 75)), 12)
    finally:
        llm.close()


@pytest.mark.parametrize("scheduler", ["halda", "memory", "compute"])
def test_a_planned_ring_gives_plain_llamas_tokens(scheduler: str, nodes, gemma_path: Path, plain) -> None:  # noqa: ANN001
    import primaplug

    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, scheduler=scheduler, node_threads=1, **LLAMA_KWARGS)
    try:
        plan = llm.plan
        assert plan is not None and plan.scheduler == scheduler and plan.k == 1
        covered = sorted((r.start, r.end) for d in plan.devices for r in d.windows if r.n_layers)
        assert covered[0][0] == 0 and covered[-1][1] == 18
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
        # the ring holds exactly the nodes the plan kept
        assert [n.name for n in llm.cluster.nodes] == [d.name for d in plan.ring[:-1]]
        if scheduler == "halda":
            # on one machine the nodes add only hops: Halda runs the model on the head and says why
            assert {d.name for d in plan.dropped} == {"node1", "node2", "node3"}
            assert all("predicted" in d.reason for d in plan.dropped)
        else:
            assert not plan.dropped and all(d.w >= 1 for d in plan.devices[1:])
        assert plan.total_s > 0 and plan.compute_s > 0
        assert_same(greedy_scores(llm, list(range(5, 75)), 12), plain)
    finally:
        llm.close()


def test_halda_keeps_nodes_when_the_head_is_short_of_memory(nodes, gemma_path: Path, plain) -> None:  # noqa: ANN001
    """A head that lends the model 160 MiB (Gemma's output layer alone is 170 MiB) cannot hold the layers as well:
    Halda puts them on the nodes, and the ring it deploys gives plain llama's tokens."""
    import primaplug

    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses, node_threads=1, memory_budget=160 << 20,
                          **LLAMA_KWARGS)
    try:
        plan = llm.plan
        assert plan is not None and plan.scheduler == "halda"
        kept = [d for d in plan.devices if d.name != plan.head.name]
        assert kept, plan.describe()
        assert plan.head.w == 0 and sum(d.w for d in kept) * plan.k == 18, plan.describe()
        assert [n.name for n in llm.cluster.nodes] == [d.name for d in plan.ring[:-1]]
        assert_same(greedy_scores(llm, list(range(5, 75)), 12), plain)
    finally:
        llm.close()


def test_links_are_measured_over_the_ring(nodes, gemma_path: Path) -> None:  # noqa: ANN001
    from primaplug.engine import read_layout
    from primaplug.head import Cluster, ClusterSettings
    from primaplug.transport import ZmqTransport
    from primaplug.wire import ModelIdentity

    layout = read_layout(gemma_path)
    t = ZmqTransport()
    ident = ModelIdentity.of(layout, gemma_path.name)
    cluster = Cluster(t, ClusterSettings(nodes=tuple(nodes.addresses)), ident)
    try:
        cluster.connect()
        latency, bps = cluster.measure_links()
        assert 0 < latency < 0.05  # loopback: well under a millisecond here, a generous bound
        assert bps > 1e7
        assert all(n.status().state == "idle" for n in cluster.nodes), "probing must leave the nodes unloaded"
    finally:
        cluster.close()
        t.close()


# a head's script (argv: the model, the nodes' addresses): `cluster`, not yet connected, and `anon()`, the process's
# anonymous memory now
HEAD_SCRIPT = """
import sys
from primaplug.engine import read_layout
from primaplug.head import Cluster, ClusterSettings
from primaplug.transport import ZmqTransport
from primaplug.wire import ModelIdentity
def anon():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon"))
t = ZmqTransport()
cluster = Cluster(t, ClusterSettings(nodes=tuple(sys.argv[2].split(","))),
                  ModelIdentity.of(read_layout(sys.argv[1]), "m.gguf"))
"""

LINK_PROBE = HEAD_SCRIPT + """
import time
def regions():  # anonymous memory by mapping, to say where what was kept lies
    out, name = {}, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                name = f"{parts[0]} {parts[5] if len(parts) > 5 else '[anon]'}"
            elif parts[0] == "Anonymous:":
                out[name] = int(parts[1]) * 1024
    return out
cluster.connect()
before, mapped = anon(), regions()
cluster.measure_links(rows=2048)
# kept: the least over the next 2 s (what the head's other threads hold a moment, such as a reply on its way, is not)
growth = []
for _ in range(21):
    growth.append(anon() - before)
    time.sleep(0.1)
grown = {k: v - mapped.get(k, 0) for k, v in regions().items() if v - mapped.get(k, 0) >= 256 << 10}
print(grown)
print(min(growth))
cluster.close()
t.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in sys.version, reason="glibc's allocator")
def test_measuring_the_links_leaves_nothing_in_the_head(nodes, gemma_path: Path) -> None:  # noqa: ANN001
    """The probes' rows (5 MiB a trip here) were freed into the heap, which glibc keeps: 10.2 MiB stayed in the head,
    the memory a small device's apps need. A trim after measuring returned them, except in about 1 suite run of 4
    (9.6 MiB kept); with large blocks mapped (head/cluster.py: connect) 0.2 MiB stays even without the trim."""
    out = subprocess.run([sys.executable, "-c", LINK_PROBE, str(gemma_path), ",".join(nodes.addresses)],
                         capture_output=True, text=True, check=True, timeout=120)
    *_, grown, growth = out.stdout.strip().splitlines()
    assert int(growth) < 3 << 20, (f"{int(growth) / 2**20:.1f} MiB kept after measuring the links; the mappings that "
                                   f"grew by 256 KiB or more, in bytes: {grown}")


HEAP_AFTER_CONNECT = HEAD_SCRIPT + """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def kept(size):  # what a block of `size` bytes, written and freed, leaves in the process
    before = anon()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
    return anon() - before
libc.free(ctypes.c_void_p(libc.malloc(24 << 20)))  # glibc's threshold rises to 24 MiB, as any program's may
print(kept(16 << 20))
libc.malloc_trim(0)  # that block's pages back, so that the next one is a fresh allocation
cluster.connect()
print(kept(16 << 20))
cluster.close()
t.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in sys.version, reason="glibc's allocator")
def test_a_connected_head_gives_back_the_large_blocks_it_frees(nodes, gemma_path: Path) -> None:  # noqa: ANN001
    """A ring's messages are large blocks. Once its threshold has risen, glibc serves them from a heap whose free top
    it keeps; a head that has connected maps them, so that each goes back to the OS when freed (memory/heap.py)."""
    out = subprocess.run([sys.executable, "-c", HEAP_AFTER_CONNECT, str(gemma_path), ",".join(nodes.addresses)],
                         capture_output=True, text=True, check=True, timeout=120)
    before, after = (int(x) for x in out.stdout.split())
    assert before > 12 << 20, f"glibc kept {before} bytes of a freed 16 MiB block: the test no longer sets the scene"
    assert after < 1 << 20, f"{after / 2**20:.1f} MiB of a freed 16 MiB block stayed in a connected head"


def test_profile_requests_are_checked(nodes, gemma_path: Path) -> None:  # noqa: ANN001
    from primaplug.core.errors import NodeError
    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.transport import ZmqTransport

    t = ZmqTransport()
    client = NodeClient(t, nodes.addresses[0])
    try:
        client.hello()
        with pytest.raises(NodeError, match="wrong_model|holds"):
            client.profile("123:not-a-model")
        profile = client.profile(read_layout(gemma_path).identity)
        assert profile.name == "node1" and profile.cpu_flops["Q4_K"] > 0 and profile.mem_available_bytes > 0
    finally:
        client.release()  # the node is this test's head's since it profiled: the next test's head deploys at once
        client.close()
        t.close()


def test_a_node_with_windows_loaded_refuses_to_profile(nodes, gemma_path: Path) -> None:  # noqa: ANN001
    """Its own windows would skew the free memory it reports: the head unloads nodes before profiling. Another head
    is refused as long as the head that deployed there runs; once it closes, the node's windows are freed."""
    import primaplug
    from primaplug.core.errors import NodeError, NodeHeldError
    from primaplug.engine import read_layout
    from primaplug.head import NodeClient
    from primaplug.transport import ZmqTransport

    identity = read_layout(gemma_path).identity
    llm = primaplug.Llama(gemma_path, nodes=nodes.addresses[:1], scheduler="even", node_threads=1, **LLAMA_KWARGS)
    t = ZmqTransport()
    same, other = NodeClient(t, nodes.addresses[0], head=llm.head), NodeClient(t, nodes.addresses[0])
    try:
        with pytest.raises(NodeError, match="unload them before profiling"):
            same.profile(identity)
        with pytest.raises(NodeHeldError, match=f"belongs to head {llm.head.id[:8]}"):
            other.profile(identity)
        llm.close()  # it lets the node go: its windows are freed
        assert other.status().state == "idle" and other.status().holder is None
        assert other.profile(identity).name == "node1"
    finally:
        llm.close()
        other.release()
        same.close()
        other.close()
        t.close()


def test_plan_command_prints_the_plan_without_deploying(gemma_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "primaplug", "plan", "--local-nodes", "2", "-m", str(gemma_path),
                          "-c", "512", "--scheduler", "memory"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "plan by memory: 18 layers, 1 round(s), 3 device(s)" in out.stdout
    assert "links (measured over the ring)" in out.stdout and "predicted" in out.stdout
    assert "node1" in out.stdout and "node2" in out.stdout


def _cluster(addresses, gemma_path: Path, timeout_s: float = 2.0):  # noqa: ANN001, ANN202
    from primaplug.engine import read_layout
    from primaplug.head import Cluster, ClusterSettings
    from primaplug.transport import ZmqTransport
    from primaplug.wire import ModelIdentity

    layout = read_layout(gemma_path)
    t = ZmqTransport()
    ident = ModelIdentity.of(layout, gemma_path.name)
    return t, Cluster(t, ClusterSettings(nodes=tuple(addresses), timeout_s=timeout_s), ident)


def test_a_node_dying_while_links_are_probed_is_named(gemma_path: Path, tmp_path: Path) -> None:
    import os
    import signal

    from primaplug.core.errors import NodeUnavailableError
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 3, log_dir=tmp_path) as local:
        t, cluster = _cluster(local.addresses, gemma_path)
        wait_loaded = cluster._wait_loaded

        def then_kill(*args) -> None:  # noqa: ANN002
            wait_loaded(*args)
            os.kill(local.nodes[1].proc.pid, signal.SIGKILL)  # loaded and relaying: gone before the first probe

        cluster._wait_loaded = then_kill
        try:
            cluster.connect()
            with pytest.raises(NodeUnavailableError, match="node2") as e:
                cluster.measure_links()
            assert "link probe" in str(e.value)
            assert cluster.nodes[0].status().state == "idle", "the survivors are left unloaded"
        finally:
            cluster.close()
            t.close()


def test_a_node_dying_while_it_profiles_is_named(gemma_path: Path, tmp_path: Path) -> None:
    import os
    import signal
    import threading

    from primaplug.core.errors import NodeUnavailableError
    from primaplug.head.events import NodeProgress
    from primaplug.head.launch import LocalNodes

    # a profile directory of its own: the node measures afresh, which takes seconds
    with LocalNodes(gemma_path, 1, log_dir=tmp_path, extra_args=["--profile-dir", str(tmp_path / "p")]) as local:
        t, cluster = _cluster(local.addresses, gemma_path)
        try:
            cluster.connect()
            said: list[str] = []

            def progress(event: object) -> None:
                if isinstance(event, NodeProgress) and event.state == "profiling":
                    said.append(event.message)
                    if len(said) == 1:  # the node has started measuring
                        threading.Timer(0.5, os.kill, (local.nodes[0].proc.pid, signal.SIGKILL)).start()

            cluster.events.subscribe(progress)
            with pytest.raises(NodeUnavailableError, match="node1.*GetProfile"):
                cluster.profiles()
            assert said and "measuring" in said[0]
        finally:
            cluster.close()
            t.close()
