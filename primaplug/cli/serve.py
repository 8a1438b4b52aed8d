"""`primaplug serve`: llama-cpp-python's OpenAI-compatible server in front of the ring, until interrupted."""

from __future__ import annotations

import argparse
from typing import Any

from primaplug.cli.common import llama_kwargs, model_path, ring_flags, ring_llama, say


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the ring through llama-cpp-python's OpenAI-compatible server")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--alias", help="model name in the API (default: the file name)")
    serve.add_argument("--chat-format", help="llama-cpp-python chat format (default: the model's own template)")
    ring_flags(serve)
    serve.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from primaplug.server import create_app

    path = model_path(args)
    kwargs = llama_kwargs(args, chat_format=args.chat_format) if args.chat_format else llama_kwargs(args)
    with ring_llama(args, path, kwargs) as llm:
        app = create_app(llm, alias=args.alias or path.name, host=args.host, port=args.port)
        import uvicorn

        say(f"serving {args.alias or path.name} at http://{args.host}:{args.port}/v1")
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
