"""Route llama.cpp's log into Python logging, and keep its last errors for exception messages.

llama-cpp-python prints the native log to stderr. primaplug sends it to the `primaplug.llama` logger instead, every
line at DEBUG and errors at INFO, so that neither a library user (Python's last-resort handler shows WARNING and
up) nor a CLI user without -v sees llama.cpp's own lines. It remembers the last error lines, so a failed native
call becomes an exception that says what llama.cpp complained about.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading

from llama_cpp import llama_cpp as _ll

logger = logging.getLogger("primaplug.llama")

# ggml_log_level (ggml.h): NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the previous line)
_ERROR = 4
_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.DEBUG, 4: logging.INFO}
_errors: collections.deque[str] = collections.deque(maxlen=8)
_lock = threading.Lock()
_installed = False
_last_level = 2
_partial: list[str] = []


@_ll.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _last_level
    if level != 5:
        _last_level = level
    _partial.append(text.decode("utf-8", errors="replace"))
    if not _partial[-1].endswith("\n"):
        return
    line = "".join(_partial).rstrip()
    _partial.clear()
    if _last_level == _ERROR:
        _errors.append(line)
    logger.log(_LEVELS.get(_last_level, logging.DEBUG), "%s", line)


def install() -> None:
    """Install the callback once per process (called when the engine first loads a model)."""
    global _installed
    with _lock:
        if not _installed:
            _ll.llama_log_set(_callback, ctypes.c_void_p(0))
            _installed = True


def take_errors() -> str:
    """The error lines llama.cpp logged since the last call, joined; clears them."""
    with _lock:
        text = "; ".join(_errors)
        _errors.clear()
    return text
