"""`primaplug node`: the daemon that holds windows of a model and serves its place in the ring."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primaplug.core import ConfigError
from primaplug.core.settings import DEFAULT_PORT, DEFAULT_WAKE_LOCK, HEAD_SILENCE_S, WAKE_LOCK_MODES

DESCRIPTION = f"""\
Run a node: it holds windows of the models given with -m and serves them to whichever head deploys an assignment.
With --model-dir instead (or as well), it needs no model file: a head whose model it lacks sends it the header and
exactly its windows' layers, each piece checked against the head's hashes, into a sparse copy in that folder
(docs/distribute.md). With neither, that folder is `models` in primaplug's cache ({{cache}}), so
`primaplug node` alone serves whatever a head deploys. A model in several files is named by any of its parts, and
merged once.

The node listens for the head on HOST:PORT (control) and for the ring on PORT+1. --listen HOST:0 picks any free
ports instead (both are printed in the node's "ready" line, which `run --local-nodes` reads). A head may give a node
a window of 0 layers in some round (or in all of them): the node then relays that round's hidden state to its
successor unchanged, which lets the ring pass through a device that computes nothing (the link probes use it).
Off loopback (any address but 127.0.0.1) the node needs --keys: every connection is then encrypted and
authenticated with CurveZMQ. Default: 127.0.0.1:{DEFAULT_PORT}."""


def default_model_dir() -> Path:
    """Where a node started without -m or --model-dir keeps the layers heads send it."""
    from primaplug.core.settings import cache_root

    return cache_root() / "models"


def add_parser(sub: Any) -> None:
    node = sub.add_parser("node", help="run a node daemon that serves windows of a model to a ring",
                          description=DESCRIPTION.format(cache="$PRIMAPLUG_CACHE, else ~/.cache/primaplug"),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    node.add_argument("-m", "--model", action="append", default=[],
                      help="GGUF file this node may load (repeat for several); no other file is ever opened")
    node.add_argument("--model-dir", metavar="DIR",
                      help="folder where the node keeps the parts of models it fetches from the cluster: a head whose "
                      "model it lacks sends it exactly its windows' layers, checked piece by piece "
                      "(docs/distribute.md; default without -m: models/ in primaplug's cache)")
    node.add_argument("--disk-budget", type=int, metavar="MiB",
                      help="what the model folder's copies may take on disk; layers no longer run go oldest first "
                      "(default: the disk's free space at start, less 1 GiB)")
    node.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}",
                      help=f"HOST:PORT of the control channel; the ring uses PORT+1; port 0: any free ports (a pair) "
                           f"(default 127.0.0.1:{DEFAULT_PORT})")
    node.add_argument("--name", help="name shown to the head (default: the host name)")
    node.add_argument("--keys", help="cluster key file (primaplug keygen); required off loopback")
    node.add_argument("--advertise", action="store_true",
                      help="announce this node on the local network (mDNS/DNS-SD) so that heads find it with "
                           "--nodes auto: its name, ports, models and a fingerprint of the cluster's public key, "
                           "no secret (docs/discovery.md)")
    node.add_argument("--memory-budget", type=int, metavar="MiB",
                      help="memory for the windows' weights (default: available memory less KV cache, buffers, 5%%)")
    node.add_argument("--no-prefetch", action="store_true", help="do not page windows in ahead of compute")
    node.add_argument("--no-release", action="store_true", help="do not drop a streamed window after it ran")
    node.add_argument("--no-keep", action="store_true", help="keep no part of streamed layers resident")
    node.add_argument("--layer-streaming", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                      help="stream windows layer by layer, keeping part of every layer and prefetching as many "
                      "layers ahead as fit: on, off (whole windows), or auto (the default: layer by layer where a "
                      "whole window would fault much of itself in page by page; docs/memory.md)")
    node.add_argument("--stream-room", type=int, metavar="LAYERS",
                      help="stream layer by layer with room for this many streamed layers beside the kept part at "
                      "once (default: a window's and one more); fewer keeps more of every layer resident, but reads "
                      "less ahead (docs/memory.md)")
    node.add_argument("--whole-experts", action="store_true",
                      help="stream a mixture of experts' layers whole, every expert included, instead of reading "
                      "only the experts its tokens choose (for comparisons: docs/memory.md)")
    node.add_argument("--cpu-strict", choices=("auto", "0", "1"), default="auto",
                      help="pin each compute thread to a core of its own (llama.cpp's name): 1 always, 0 never, "
                      "auto when the threads use every core (default)")
    node.add_argument("--profile-dir", help="where this device's measured profile is cached "
                      "(default ~/.cache/primaplug/profiles; give each emulated device its own)")
    node.add_argument("--wake-lock", choices=WAKE_LOCK_MODES, default=DEFAULT_WAKE_LOCK,
                      help="hold Termux's wake lock (termux-wake-lock) while the node runs, so that Android does not "
                      "suspend it with the screen off: on, off, or auto: on under Termux (default "
                      f"{DEFAULT_WAKE_LOCK}; docs/platforms.md)")
    node.add_argument("--exit-with-parent", action="store_true",
                      help="stop when the process that started this node ends (how a head's --local-nodes go with it, "
                      "however it ends)")
    node.add_argument("--release-after", type=float, default=HEAD_SILENCE_S, metavar="SECONDS",
                      help="free the loaded windows after this long without a word from any head (it has gone), "
                      f"and go idle until one deploys again; 0: never (default {HEAD_SILENCE_S:g})")
    node.set_defaults(func=main)


log = logging.getLogger("primaplug.node")


def main(args: argparse.Namespace) -> int:
    import platform

    from primaplug.engine import bindings_only

    bindings_only()  # a node never uses llama_cpp.Llama: 4 MiB less of its device's memory (engine/_bindings.py)
    from primaplug.memory.heap import map_large_blocks

    map_large_blocks()  # what the node frees goes back to the device's owner (memory/heap.py)
    from primaplug.device import MemorySettings
    from primaplug.memory.prefetcher import Switches
    from primaplug.node import Node, NodeSettings
    from primaplug.node.wakelock import WakeLock
    from primaplug.transport import ZmqTransport, load_keys, split_address

    if not args.verbose:  # say what the node does (loads, refusals), not each message
        for name in ("primaplug.node", "primaplug.transport", "primaplug.device", "primaplug.discovery"):
            logging.getLogger(name).setLevel(logging.INFO)
    if args.stream_room is not None and (args.layer_streaming == "off" or args.stream_room < 1):
        raise ConfigError(f"--stream-room {args.stream_room}: give a number of layers, 1 or more, and stream layer "
                          "by layer (not with --layer-streaming off)")
    layers = True if args.stream_room is not None else {"on": True, "off": False}.get(args.layer_streaming)
    host, port = split_address(args.listen)
    keys = load_keys(args.keys) if args.keys else None
    memory = MemorySettings(
        budget_bytes=args.memory_budget << 20 if args.memory_budget is not None else None,
        switches=Switches(prefetch=not args.no_prefetch, release=not args.no_release, keep=not args.no_keep,
                          layers=layers, room_layers=args.stream_room,
                          experts=not args.whole_experts))
    from primaplug.cli.common import resolve

    args.model = [str(resolve(m)) for m in args.model]  # a model in several files is merged once (store/hub.py)
    if not args.model and not args.model_dir:  # `primaplug node` alone: fetch whatever a head deploys
        args.model_dir = str(default_model_dir())
    settings = NodeSettings(models=tuple(Path(m) for m in args.model), host=host, port=port,
                            name=args.name or platform.node(), secure=keys is not None, memory=memory,
                            profile_dir=Path(args.profile_dir) if args.profile_dir else None,
                            pin_threads={"auto": None, "0": False, "1": True}[args.cpu_strict],
                            release_after_s=args.release_after, exit_with_parent=args.exit_with_parent,
                            model_dir=Path(args.model_dir) if args.model_dir else None,
                            disk_budget_bytes=args.disk_budget << 20 if args.disk_budget is not None else None)
    transport = ZmqTransport(keys)
    try:
        node = Node(settings, transport)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal(node))
        ring = node.ring.address
        ctl_host, _, ctl_port = node.control.address.rpartition(":")
        if node.store is not None:  # on stderr: stdout's one line is "ready" (`run --local-nodes` reads it)
            print(f"primaplug node {node.name}: layers that heads send go to {node.store.folder} (--model-dir DIR), "
                  f"within {node.store.budget_bytes / 2**30:.1f} GiB of its disk (--disk-budget MiB); listening on "
                  f"{ctl_host}:{ctl_port}" + (" (loopback only: --listen HOST:PORT with --keys for other devices)"
                                              if keys is None else ""), file=sys.stderr, flush=True)
        with WakeLock(args.wake_lock):  # before "ready": a required lock that fails stops the node first
            print(f"primaplug node {node.name} ready: control {ctl_host}:{ctl_port} ring {ring}", flush=True)
            advertiser = _advertise(args, node.name, host, int(ctl_port), ring, keys) if args.advertise else None
            try:
                node.serve()
            finally:
                if advertiser is not None:
                    advertiser.close()
        if node.lingering():  # a compute or a load that did not finish in time: the process's exit frees it
            logging.shutdown()
            os._exit(0)
    finally:
        transport.close()
    return 0


def _on_signal(node: Any) -> Callable[[int, Any], None]:
    """SIGTERM or SIGINT: the node frees its windows and exits, whatever it is doing. The kernel ends the process
    STOP_DEADLINE_S later if that hangs (SIGALRM's default action needs no Python code to run), and a second signal
    ends it at once."""
    from primaplug.core.settings import STOP_DEADLINE_S

    def handle(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if node.stopping:
            log.warning("node %s: %s again: exiting now", node.name, name)
            logging.shutdown()
            os._exit(128 + signum)
        log.warning("node %s: %s: stopping (the process ends within %d s)", node.name, name, STOP_DEADLINE_S)
        if hasattr(signal, "alarm"):
            signal.alarm(STOP_DEADLINE_S)
        node.stop(name)

    return handle


def _advertise(args: argparse.Namespace, name: str, host: str, port: int, ring: str, keys: Any) -> Any:
    """Announce the node (--advertise) in the background; the node serves meanwhile."""
    from primaplug.discovery import Advertiser
    from primaplug.engine import read_layout

    # a node that fetches runs any model a head holds: it announces none, which heads take as "may run this one"
    models = [] if args.model_dir else [read_layout(Path(m)).identity for m in args.model]
    return Advertiser(name=name, host=host, port=port, ring_port=int(ring.rpartition(":")[2]), models=models,
                      keys=keys).start()
