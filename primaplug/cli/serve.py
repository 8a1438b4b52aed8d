"""`primaplug serve`: the OpenAI-compatible server (primaplug/server/) in front of the ring, until interrupted.

Flags that llama-cpp-python's server also has keep its names (--api_key, --ssl_keyfile, --ssl_certfile,
--interrupt_requests, --config_file, --embedding) and, where it has one, its default (primaplug/server/settings.py).
Settings come from three places, the first that has one winning: the command line, the config file, the defaults.
docs/serving.md says the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
from pathlib import Path
from typing import Any

from primaplug.cli.common import llama_kwargs, model_path, ring_flags, ring_llama, say
from primaplug.core import ConfigError
from primaplug.server.settings import ServeSettings
from primaplug.transport.addresses import is_loopback

SERVE = ServeSettings()
# llama-cpp-python's ModelSettings keys (an entry of the config file's `models`) that serve takes, and the flag
# (its dest) each one sets; its ServerSettings keys that serve takes are its flags' own names
MODEL_KEYS = {"model": "model", "model_alias": "alias", "n_ctx": "ctx_size", "n_batch": "batch_size",
              "n_ubatch": "ubatch_size", "n_threads": "threads", "chat_format": "chat_format",
              "embedding": "embedding"}
# llama-cpp-python's own words for true and false (llama_cpp/server/cli.py, _parse_bool_arg)
TRUE, FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the ring through an OpenAI-compatible HTTP API (llama-cpp-python's)",
                           description="Serve the ring through llama-cpp-python's OpenAI-compatible API, many "
                                       "requests at once. docs/serving.md has every flag and the config file.")
    _suppress_defaults(add_flags(serve))
    serve.set_defaults(func=main)


def add_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add serve's flags to a parser; returns their actions."""
    p = _Recording(parser)
    add = p.add_argument
    add("--host", default=SERVE.host,
        help=f"HTTP address (default {SERVE.host}); off loopback, serve needs --api_key or --insecure")
    add("--port", type=int, default=SERVE.port, help=f"HTTP port (default {SERVE.port})")
    add("--alias", help="the model's id in the API (llama-cpp-python's model_alias; default: the --model path "
                        "as given, else the bundled model's file name)")
    add("--chat-format", help="llama-cpp-python chat format (default: the model's own template)")
    add("-np", "--parallel", type=int, default=SERVE.n_parallel, metavar="N",
        help=f"sequences on the ring: requests served at once, each with -c positions of context (default "
             f"{SERVE.n_parallel}; llama.cpp's server's --parallel); more requests wait for a free one")
    add("--api_key", help="clients must send this key as a bearer token (Authorization: Bearer KEY, the openai "
                          "client's api_key) on /v1, /extras and /metrics; /health needs none")
    add("--insecure", action="store_true",
        help="serve off loopback without --api_key: anyone who reaches the port may use the ring")
    add("--ssl_keyfile", metavar="PATH", help="TLS private key (PEM), with --ssl_certfile: serve HTTPS")
    add("--ssl_certfile", metavar="PATH", help="TLS certificate chain (PEM): serve HTTPS")
    add("--interrupt_requests", type=_boolean, nargs="?", const=True, default=SERVE.interrupt_requests,
        metavar="BOOL",
        help="stop a streaming request when another request is waiting for a sequence (llama-cpp-python's "
             "setting; default off here, on there: llama-cpp-python serves one request at a time, and stopping "
             "a stream is how a waiting one gets the model; the ring serves -np at once and a waiting request "
             "gets the next free sequence). --interrupt_requests, --interrupt_requests true|false, "
             "--no-interrupt_requests")
    add("--no-interrupt_requests", dest="interrupt_requests", action="store_false", help=argparse.SUPPRESS)
    add("--embedding", type=_boolean, nargs="?", const=True, default=False, metavar="BOOL",
        help="serve /v1/embeddings (llama-cpp-python's setting: the Llama is made with embedding=True)")
    add("--config_file", metavar="PATH",
        help="settings from a JSON or YAML file (.yaml/.yml) in llama-cpp-python's shape (host, port, api_key, "
             "..., and models: [{model, model_alias, n_ctx, chat_format, ...}]) plus serve's own flags by their "
             "long names (nodes, layers, parallel, ...); flags on the command line win")
    ring_flags(p, ctx_size=SERVE.n_ctx)  # type: ignore[arg-type]
    return p.actions


class _Recording:
    """Hands add_argument on to a parser and records each flag's action (argparse keeps them private); ring_flags
    adds its flags to it as to a parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.actions: list[argparse.Action] = []

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        action = self.parser.add_argument(*names, **kwargs)
        self.actions.append(action)
        return action


def _suppress_defaults(actions: list[argparse.Action]) -> None:
    """No default in the namespace: what is there was given (on the command line, or in the config file), so that
    the command line wins over the file and the file over the defaults. On the actions, not by set_defaults, whose
    parser-level default argparse would convert as a value."""
    for action in actions:
        action.default = argparse.SUPPRESS


def _boolean(text: str) -> bool:
    word = text.lower().strip()
    if word in TRUE | FALSE:
        return word in TRUE
    raise argparse.ArgumentTypeError(f"expected true or false (or {', '.join(sorted(TRUE | FALSE))}), got {text!r}")


def settings(args: argparse.Namespace) -> argparse.Namespace:
    """Every setting: the command line's (args: the flags given, nothing else), else the config file's, else the
    defaults."""
    given = vars(args)
    defaults_parser = argparse.ArgumentParser(add_help=False)
    add_flags(defaults_parser)
    merged = {**vars(defaults_parser.parse_args([]))}
    if given.get("config_file"):
        merged.update(read_config(Path(given["config_file"])))
    merged.update(given)
    return argparse.Namespace(**merged)


def read_config(path: Path) -> dict[str, Any]:
    """The settings a config file gives, by flag dest, converted as the flags convert their text."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--config_file {path}: {e.strerror or e}") from None
    if path.suffix in (".yaml", ".yml"):  # as llama-cpp-python tells them
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"--config_file {path}: a YAML file needs PyYAML (pip install pyyaml), or write it as "
                              "JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--config_file {path} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config_file {path} is not valid JSON ({e}); a YAML file ends in .yaml or .yml"
                              ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config_file {path}: expected a mapping of settings, got {type(data).__name__}")
    models = data.pop("models", [])
    if not isinstance(models, list) or len(models) > 1 or not all(isinstance(m, dict) for m in models):
        raise ConfigError(f"--config_file {path}: `models` is a list of one model (a mapping: model, model_alias, "
                          "n_ctx, ...): a ring serves one model")

    parse = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    actions = add_flags(parse)
    _suppress_defaults(actions)
    by_dest: dict[str, argparse.Action] = {}
    for action in actions:
        by_dest.setdefault(action.dest, action)  # --interrupt_requests before --no-interrupt_requests
    by_name = {option.lstrip("-").replace("-", "_"): action for action in actions
               for option in action.option_strings if option.startswith("--")}
    chosen: dict[str, tuple[str, argparse.Action, Any]] = {}  # dest: (key, action, value)
    unknown = []
    entries = [(key, by_name.get(key.replace("-", "_")), value) for key, value in data.items()]
    entries += [(f"models[0].{key}", by_dest.get(MODEL_KEYS.get(key, "")), value)
                for key, value in (models[0] if models else {}).items()]
    for key, action, value in entries:
        if action is None or action.dest == "config_file":
            unknown.append(key)
        elif action.dest in chosen:
            raise ConfigError(f"--config_file {path}: {chosen[action.dest][0]} and {key} set the same thing: keep one")
        else:
            chosen[action.dest] = (key, action, value)
    if unknown:
        raise ConfigError(f"--config_file {path}: {_describe_unknown(unknown)}")

    out: dict[str, Any] = {}
    for key, action, value in chosen.values():
        option = next(o for o in action.option_strings if o.startswith("--"))
        try:
            if action.nargs == 0:  # a switch (--insecure, --reprofile): true sets it, false leaves the default
                if not isinstance(value, bool):
                    raise ConfigError(f"--config_file {path}: {key} is true or false, got {value!r}")
                if value:
                    out.update(vars(parse.parse_args([option])))
                continue
            out.update(vars(parse.parse_args([f"{option}={_as_text(value)}"])))  # = : a value may start with -
        except argparse.ArgumentError as e:
            raise ConfigError(f"--config_file {path}: {key}: {e.message}") from None
    return out


def _as_text(value: Any) -> str:
    """A config value as the flag's text: a list as comma-separated items (--nodes, --layers)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def _describe_unknown(keys: list[str]) -> str:
    from primaplug.server.settings import llama_cpp_setting_names

    server_keys, model_keys = llama_cpp_setting_names()
    theirs = [k for k in keys if (k.removeprefix("models[0].") in model_keys if k.startswith("models[0].")
                                  else k in server_keys)]
    others = [k for k in keys if k not in theirs]
    parts = []
    if theirs:
        parts.append(f"llama-cpp-python settings that primaplug serve does not take: {', '.join(theirs)}")
    if others:
        parts.append(f"unknown keys: {', '.join(others)}")
    return ("; ".join(parts) + ". Remove them. serve takes host, port, api_key, ssl_keyfile, ssl_certfile, "
            f"interrupt_requests, models[0]'s {', '.join(MODEL_KEYS)}, and its flags' long names (nodes, layers, "
            "parallel, ...): docs/serving.md")


def check(args: argparse.Namespace) -> None:
    """What serve refuses before it loads anything."""
    if args.api_key is not None and not args.api_key:
        raise ConfigError("--api_key is empty: give a key, or leave the flag out")
    if not is_loopback(args.host) and args.api_key is None and not args.insecure:
        raise ConfigError(f"--host {args.host} is off this machine's loopback and no --api_key is set: anyone who "
                          "reaches the port could use the ring. Pass --api_key KEY (clients send it as their OpenAI "
                          "API key), or --insecure to serve without one on a network you trust")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ConfigError("--ssl_keyfile needs --ssl_certfile (the certificate that goes with the key)")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        file = getattr(args, flag)
        if file and not Path(file).is_file():
            raise ConfigError(f"--{flag} {file}: no such file")
    if getattr(args, "model_draft", None) and args.parallel > 1:
        raise ConfigError(f"a draft model (--model-draft) serves one request at a time for now, and --parallel is "
                          f"{args.parallel}: add --parallel 1, or leave the draft out to serve several at once")


def url(args: argparse.Namespace) -> str:
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    return f"{'https' if args.ssl_certfile else 'http'}://{host}:{args.port}/v1"


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the ring is deployed, so that a port in use fails at once, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot serve on {host}:{port}: {e.strerror or e}; choose another --port or --host, or "
                          "stop what uses it") from None
    return sock


def main(args: argparse.Namespace) -> int:
    args = settings(args)
    check(args)
    from primaplug.server import create_app

    path = model_path(args)
    alias = args.alias or args.model or path.name
    extra: dict[str, Any] = {"n_parallel": args.parallel}
    if args.chat_format:
        extra["chat_format"] = args.chat_format
    if args.embedding:
        extra["embedding"] = True
    with bind(args.host, args.port) as sock, ring_llama(args, path, llama_kwargs(args, **extra)) as llm:
        app = create_app(llm, alias=alias, api_key=args.api_key, interrupt_requests=args.interrupt_requests)
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(app, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                               log_level="warning"))
        if args.ssl_certfile is None and not is_loopback(args.host) and args.api_key is not None:
            say("warning: without --ssl_certfile the API key and every request travel unencrypted")
        if llm.chat_format_fallback:
            # a base model's file has no template, and chatting through the format its tokenizer suggests gives
            # noise: say which format /v1/chat/completions uses, and that /v1/completions continues plain text
            say(f"chat completions use the {llm.chat_format} format ({llm.chat_format_reason}); a base model "
                "answers better through /v1/completions, and --chat-format chooses another format")
        sock.listen(2048)  # from here a client that connects waits for uvicorn rather than being refused
        say(f"serving {alias} at {url(args)} ({args.parallel} requests at once); Ctrl-C stops")
        # uvicorn raises the Ctrl-C again once it has shut down: that is how serve ends, not an error
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
        say("stopped serving")
    return 0
