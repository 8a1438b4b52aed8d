"""What `primaplug serve` and `create_app` run with, and their defaults, defined once.

Where llama-cpp-python's server has the same setting (its ServerSettings and ModelSettings), the default is its own,
so a client or a config file written for `python -m llama_cpp.server` meets the same server; tests/test_serve_unit.py
checks them against llama-cpp-python's. The differences, each on purpose:

- host: 127.0.0.1, not "localhost": loopback either way, but an address, so the off-loopback rule of `serve` (an
  API key, or --insecure) never depends on what a name resolves to.
- interrupt_requests: off, not on. llama-cpp-python serves one request at a time, and stopping a stream is how a
  waiting request gets the model; a ring serves n_parallel requests at once, so a stream is stopped only when an
  operator asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000  # llama-cpp-python's
    n_ctx: int = 2048  # positions each sequence holds; llama-cpp-python's ModelSettings.n_ctx
    # sequences on the ring: requests in flight at once (llama.cpp's server: --parallel); a request that finds them
    # all busy waits for one
    n_parallel: int = 4
    interrupt_requests: bool = False
    api_key: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None


def worker_threads(n_parallel: int) -> int:
    """Threads that run requests: each request holds one from before it waits for a sequence until it ends (a
    stream: until its last chunk is sent), so more than n_parallel, that the requests waiting for a sequence wait
    inside the Llama, in order, and are counted there. anyio's default is 40 for the whole process."""
    return max(40, n_parallel + 8)


def llama_cpp_setting_names() -> tuple[frozenset[str], frozenset[str]]:
    """The keys of llama-cpp-python's config file: its ServerSettings' (top level) and ModelSettings' (each entry of
    `models`), so that `serve --config_file` tells a setting of llama-cpp-python it does not take from a typo."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    return frozenset(ServerSettings.model_fields), frozenset(ModelSettings.model_fields)
