"""The `primaplug` command: the composition root. Each command is a module of this package with `add_parser`
and `main`; this one builds the parser, sets up logging and turns primaplug's errors into one line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from primaplug.cli import dashboard, doctor, engine, health, keygen, layout, node, plan, run, serve, synth
from primaplug.core import PrimaplugError

COMMANDS = (run, serve, dashboard, plan, node, doctor, health, keygen, synth, layout, engine)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="primaplug", description="Run large GGUF models across home devices.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log debug output, llama.cpp's own included")
    sub = ap.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for p in sub.choices.values():  # -v after the command too (primaplug run -v ...)
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="as primaplug -v")
    return ap


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `docker stop`, systemd and `kill` send), raised in the main thread as Ctrl-C is, so that a head
    ends as it does on Ctrl-C: its nodes let go, its local nodes stopped, `serve` shut down gracefully."""


def _terminate(_signum: int, _frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # a node stops its own way; the dashboard's terminal app is left to Textual (its local nodes end with it anyway)
    if args.command not in ("node", "dashboard") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args.func(args))
    except PrimaplugError as e:
        print(f"primaplug: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print("primaplug: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("primaplug: interrupted", file=sys.stderr)
        return 130
