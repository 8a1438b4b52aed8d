"""llama-cpp-python's OpenAI-compatible server (FastAPI) in front of a ring.

The server keeps its models in a `LlamaProxy` that loads them from settings. Here the model is already
deployed, so the proxy hands out the given primaplug.Llama instead of loading a file; everything else (routes,
streaming, request locks, error handling) is llama-cpp-python's. Needs `pip install primaplug[server]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from primaplug.core.errors import ConfigError


def _server_modules() -> tuple[Any, Any, Any]:
    try:
        import llama_cpp.server.app as server_app
        from llama_cpp.server.model import LlamaProxy
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError as e:
        raise ConfigError(f"the HTTP server needs llama-cpp-python's server extras ({e.name} is missing): "
                          "pip install 'primaplug[server]'") from None
    return server_app, LlamaProxy, (ModelSettings, ServerSettings)


@contextlib.contextmanager
def _proxy_class(server_app: Any, cls: type) -> Iterator[None]:
    original = server_app.LlamaProxy
    server_app.LlamaProxy = cls
    try:
        yield
    finally:
        server_app.LlamaProxy = original


def create_app(llm: Any, *, alias: str, host: str = "127.0.0.1", port: int = 8000) -> Any:
    """A FastAPI app serving `llm` (a primaplug.Llama) under the model name `alias`."""
    server_app, llama_proxy, (model_settings, server_settings) = _server_modules()

    class RingProxy(llama_proxy):  # type: ignore[misc, valid-type]
        def __init__(self, models: list[Any]) -> None:
            settings = models[0]
            self._model_settings_dict = {alias: settings}
            self._default_model_settings, self._default_model_alias = settings, alias
            self._current_model, self._current_model_alias = llm, alias

        def __call__(self, model: str | None = None) -> Any:
            return llm  # one ring, whatever name the request gives

        def free(self) -> None:
            pass  # the ring belongs to whoever made it

    with _proxy_class(server_app, RingProxy):
        return server_app.create_app(server_settings=server_settings(host=host, port=port),
                                     model_settings=[model_settings(model=llm.model_path, model_alias=alias)])
