"""`primaplug health`: whether a node answers, for a container's HEALTHCHECK (the Dockerfile's) or a script."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from primaplug.core import PrimaplugError
from primaplug.core.settings import DEFAULT_PORT

DESCRIPTION = """\
Say Hello to a node over its control channel (with the cluster key when it has one, as a head does) and print
what it answers: its name, primaplug version and models. Exit 0 when it answers within --timeout, 1 (with why)
when it does not: Docker reads 1 as unhealthy. A Hello does not count as a head's word, so checking a node does
not keep windows an absent head left it (--release-after)."""


def add_parser(sub: Any) -> None:
    health = sub.add_parser("health", help="check that a node answers (a container's health check)",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    health.add_argument("address", nargs="?", default=f"127.0.0.1:{DEFAULT_PORT}",
                        help=f"HOST:PORT of the node's control channel (default 127.0.0.1:{DEFAULT_PORT})")
    health.add_argument("--keys", help="cluster key file (primaplug keygen); needed for a node started with --keys")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    health.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from primaplug.head.nodes import NodeClient
    from primaplug.transport import ZmqTransport, load_keys

    try:
        transport = ZmqTransport(load_keys(args.keys) if args.keys else None)
        try:
            client = NodeClient(transport, args.address, timeout_s=args.timeout)
            try:
                welcome = client.hello()
            finally:
                client.close()
        finally:
            transport.close()
    except PrimaplugError as e:  # 1, not the CLI's 2: Docker reserves 2
        print(f"primaplug: unhealthy: {e}", file=sys.stderr)
        return 1
    models = ", ".join(m.file_name for m in welcome.models)
    print(f"node {welcome.node} at {args.address} answers: primaplug {welcome.software}, {models}")
    return 0
