"""`primaplug keygen`: make the cluster key file that CurveZMQ encrypts and authenticates the ring with."""

from __future__ import annotations

import argparse
from typing import Any

from primaplug.cli.common import say


def add_parser(sub: Any) -> None:
    keygen = sub.add_parser("keygen", help="make a cluster key file for CurveZMQ")
    keygen.add_argument("path", nargs="?", default="cluster.key")
    keygen.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from primaplug.transport import generate_keys

    keys = generate_keys(args.path)
    say(f"wrote {args.path} (public key {keys.public.decode()}); copy it to every node and the head, and pass "
        "--keys to each")
    return 0
