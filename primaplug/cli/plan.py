"""`primaplug plan`: profile every device and print the scheduler's plan with its predicted time per token,
without deploying."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from primaplug.cli.common import EventLines, draft_flags, model_path, node_addresses, plan_settings, ring_flags
from primaplug.core import PrimaplugError


def add_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="profile the devices and print the scheduler's plan, without deploying")
    ring_flags(plan, deploys=False)
    draft_flags(plan)
    plan.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not (args.nodes or args.local_nodes):
        raise PrimaplugError("plan needs --nodes HOST:PORT,... or --local-nodes N")
    if args.scheduler == "even":
        raise PrimaplugError("plan shows what a scheduler chooses: --scheduler even splits by hand, with nothing to "
                             "plan; use halda, memory or compute")
    from primaplug.engine import read_layout
    from primaplug.head import Cluster, ClusterSettings, Events
    from primaplug.head.planning import draft_bytes, measure, plan_cluster, plan_with_speculation
    from primaplug.transport import ZmqTransport, load_keys
    from primaplug.wire import ModelIdentity

    path = model_path(args)
    layout = read_layout(path)
    layout.check_supported()
    events = Events()
    events.subscribe(EventLines(plan_lines=False))  # the plan is the command's output, on stdout
    with node_addresses(args, path) as addresses:
        transport = ZmqTransport(load_keys(args.keys) if args.keys else None)
        settings = ClusterSettings(nodes=tuple(addresses), n_ctx=args.ctx_size, n_batch=args.batch_size,
                                   n_ubatch=args.ubatch_size, listen=args.listen, timeout_s=args.timeout)
        cluster = Cluster(transport, settings, ModelIdentity.of(layout, path.name), events, layout=layout)
        try:
            cluster.connect()
            ps = plan_settings(args)
            ps = dataclasses.replace(ps, head_reserved_bytes=draft_bytes(args.model_draft, args.ctx_size,
                                                                         args.batch_size, args.ubatch_size))
            measured = measure(cluster, path, layout, ps)
            print(profiles_table(measured))
            plan = plan_cluster(cluster, measured, ps)
            if args.model_draft:
                from primaplug.engine.speculative import measure_draft

                draft_s = measure_draft(args.model_draft, n_ctx=args.ctx_size, n_batch=args.batch_size,
                                        n_threads=0)
                plan = plan_with_speculation(plan, draft_s, args.draft_min, args.draft_max)
            print(plan.describe())
        finally:
            cluster.close()
            transport.close()
    return 0


def profiles_table(measured: Any) -> str:
    gb = 1e9
    lines = [f"model {measured.model.name}: {measured.model.n_layer} layers of "
             f"{measured.model.layer_bytes / gb:.3f} GB, "
             f"KV {measured.model.kv_bytes_per_token_layer} B/token/layer for {measured.model.n_kv} tokens"
             + (f"; {measured.model.experts.describe()}" if measured.model.experts else ""),
             f"links (measured over the ring): {measured.link_latency_s * 1000:.2f} ms, "
             f"{measured.link_bps * 8 / 1e6:.0f} Mbit/s per hop"]
    for d in measured.devices:
        flops = ", ".join(f"{q} {f / 1e9:.0f}" for q, f in d.cpu_flops.items())
        lines.append(f"  {d.name}: {d.os}/{d.backend}, {d.cpu_count} cores, CPU GFLOP/s {flops}; RAM "
                     f"{d.mem_available_bytes / gb:.2f} of {d.mem_total_bytes / gb:.2f} GB free, read "
                     f"{d.cpu_read_bps / gb:.1f} GB/s; disk {d.disk_seq_bps / 1e6:.0f} MB/s seq, "
                     f"{d.disk_rand_bps / 1e6:.0f} MB/s random" + (f"; VRAM {d.vram_free_bytes / gb:.1f} GB free"
                                                                  if d.vram_free_bytes else ""))
    return "\n".join(lines)
