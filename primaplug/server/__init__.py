"""OpenAI-compatible HTTP in front of a primaplug.Llama: llama-cpp-python's API, many requests at once (app.py),
its settings (settings.py) and metrics (metrics.py).

`create_app` loads FastAPI and llama-cpp-python's server on first use, so that the CLI can read the settings'
defaults without them.
"""

from typing import Any

from primaplug.core.errors import ConfigError
from primaplug.server.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        try:
            from primaplug.server.app import create_app
        except ImportError as e:
            raise ConfigError(f"the HTTP server needs llama-cpp-python's server extras ({e.name} is missing): "
                              "pip install 'primaplug[server]'") from None
        return create_app
    raise AttributeError(f"module 'primaplug.server' has no attribute {name!r}")
