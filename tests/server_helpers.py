"""Shared by the server tests: an app served by uvicorn in a thread on a free port (as users run it, sockets and
all), llama-cpp-python's own server as the reference, and a strict reader of Prometheus' text format."""

from __future__ import annotations

import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tests.ring_helpers import THREADS

# the sizes the server tests use, for the ring and for llama-cpp-python's own server alike
SERVE_KWARGS: dict[str, Any] = dict(n_ctx=512, n_batch=64, n_ubatch=32, n_threads=THREADS, n_threads_batch=THREADS,
                                     verbose=False)


class ThreadedServer:
    """`with ThreadedServer(app) as s:` serves the app at s.url until the block ends."""

    def __init__(self, app: Any, **config: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def llama_cpp_server(model: Path, **model_settings: Any) -> Any:
    """llama-cpp-python's own OpenAI server (its create_app, which loads the model itself) as a TestClient. It keeps
    its model in module state: one at a time per process."""
    from fastapi.testclient import TestClient
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    settings = {**SERVE_KWARGS, **model_settings}
    return TestClient(create_app(server_settings=ServerSettings.model_validate({}),
                                 model_settings=[ModelSettings.model_validate({"model": str(model), **settings})]))


def openai_client(base_url: str, api_key: str = "none", **kwargs: Any) -> Any:
    """The official client as users make it; no retries, so that a refusal shows at once."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, **kwargs)


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(?:,|$)')
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def parse_prometheus(text: str) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    """Every sample of Prometheus' text format (0.0.4), by name and labels; fails on anything malformed: a sample
    before its family's TYPE, a family typed twice, a bad label or value, a histogram whose buckets do not add up."""
    assert text.endswith("\n"), "the text must end with a line feed"
    types: dict[str, str] = {}
    samples: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert re.match(rf"^# HELP {_NAME} ", line + " "), line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in _TYPES and name not in types, line
            types[name] = kind
        elif line.startswith("#") or not line:
            continue
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample: {line!r}"
            name, labels_text, value = m.groups()
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            family = base if types.get(base) in ("histogram", "summary") else name
            assert family in types, f"{name} has no TYPE before it"
            labels: list[tuple[str, str]] = []
            rest = labels_text or ""
            while rest:
                lm = _LABEL.match(rest)
                assert lm, f"bad labels in {line!r}"
                labels.append((lm[1], lm[2]))
                rest = rest[lm.end():]
            key = frozenset(labels)
            assert key not in samples.setdefault(name, {}), f"{line!r} repeats a sample"
            samples[name][key] = float(value)
    for family, kind in types.items():
        if kind != "histogram":
            continue
        for key, count in samples.get(f"{family}_count", {}).items():
            buckets = sorted(((float(dict(k)["le"]), v) for k, v in samples[f"{family}_bucket"].items()
                              if k - {("le", dict(k)["le"])} == key))
            assert buckets[-1][0] == math.inf and buckets[-1][1] == count, (family, buckets, count)
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False)), (family, buckets)
    return samples


def value(samples: dict[str, dict[frozenset[tuple[str, str]], float]], name: str, **labels: str) -> float:
    return samples.get(name, {}).get(frozenset(labels.items()), 0.0)
