"""`primaplug dashboard`: the Textual coordinator (primaplug/tui/). Without --nodes or --local-nodes it opens the
cluster it last ran (nodes, keys file, model, plan), remembered in the user's config directory."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
from pathlib import Path
from typing import Any

from primaplug.cli.common import AUTO, RUN, addresses, browsing, default_model, draft_flags, plan_settings
from primaplug.core import PrimaplugError


def add_parser(sub: Any) -> None:
    d = sub.add_parser("dashboard", help="the terminal dashboard: nodes, plan, deploy, chat, live figures")
    d.add_argument("-m", "--model", help="GGUF file (default: the last one, else the bundled Gemma 3 270M)")
    d.add_argument("--nodes", type=addresses, help="HOST:PORT of each `primaplug node`, in ring order; auto: add "
                   "the nodes of this cluster that advertise themselves (node --advertise) as they appear "
                   "(default: the cluster the dashboard last ran)")
    d.add_argument("--local-nodes", type=int, default=None, metavar="N",
                   help="start N nodes on this machine, stopped when the dashboard quits")
    d.add_argument("--keys", help="cluster key file (primaplug keygen); needed for nodes off this machine")
    d.add_argument("--listen", default=RUN.listen, help="address the head receives the ring's output on")
    d.add_argument("--timeout", type=float, default=RUN.timeout_s,
                   help=f"seconds a silent node may take (default {RUN.timeout_s:g})")
    d.add_argument("-c", "--ctx-size", type=int, default=RUN.n_ctx, help=f"context size (default {RUN.n_ctx})")
    d.add_argument("-b", "--batch-size", type=int, default=RUN.n_batch)
    d.add_argument("-ub", "--ubatch-size", type=int, default=RUN.n_ubatch)
    d.add_argument("--node-threads", type=int, default=RUN.node_threads)
    d.add_argument("--slow-disk", type=float, default=400, metavar="MB/s",
                   help="disks reading at most this fast never stream layers under halda (default 400)")
    d.add_argument("--latency-model", choices=("ring", "paper"), default="ring")
    d.add_argument("--chat-format", help="llama-cpp-python chat format, e.g. gemma (default: the model's own "
                   "template; a model without one has each message continued as text, and the log names the format "
                   "its tokenizer suggests)")
    d.add_argument("--forget", action="store_true", help="start from an empty cluster, not the remembered one")
    draft_flags(d)
    d.set_defaults(func=main, scheduler="halda", rounds=None, reprofile=False)


def main(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("textual") is None:
        raise PrimaplugError("the dashboard needs Textual: pip install 'primaplug[dashboard]' (make setup installs "
                             "it)")
    from primaplug.head.coordinator import Coordinator
    from primaplug.tui.app import DashboardApp
    from primaplug.tui.config import Remembered

    remembered = Remembered() if args.forget else Remembered.load()
    if args.nodes is not None or args.local_nodes is not None:  # a cluster given replaces the remembered one
        remembered.discover = args.nodes == [AUTO]
        remembered.nodes = [] if remembered.discover else list(args.nodes or [])
        remembered.local_nodes = args.local_nodes or 0
    if args.keys:
        remembered.keys = args.keys
    if args.model:
        remembered.model = str(Path(args.model).resolve())
    path = Path(remembered.model) if remembered.model else default_model()
    if not path.exists():
        raise PrimaplugError(f"the model {path} does not exist: pass -m MODEL.gguf")
    coordinator = Coordinator(path, remembered.nodes, keys=remembered.keys, listen=args.listen,
                              timeout_s=args.timeout, n_ctx=args.ctx_size, n_batch=args.batch_size,
                              n_ubatch=args.ubatch_size, node_threads=args.node_threads,
                              chat_format=args.chat_format, plan_settings=plan_settings(args),
                              draft_model=args.model_draft, draft_max=args.draft_max, draft_min=args.draft_min)
    with contextlib.ExitStack() as stack:
        discovered = None
        if remembered.discover:  # --nodes auto: nodes are added as they advertise themselves
            discovered = stack.enter_context(browsing(remembered.keys, coordinator.layout.identity)).addresses
        DashboardApp(coordinator, local_nodes=remembered.local_nodes, remembered=remembered,
                     discovered=discovered).run()
    return 0
