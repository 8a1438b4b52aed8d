"""OpenAI-compatible HTTP: llama-cpp-python's own server, serving a primaplug.Llama."""

from primaplug.server.app import create_app

__all__ = ["create_app"]
