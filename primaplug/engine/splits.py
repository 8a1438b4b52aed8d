"""Models in several files (`name-00001-of-00003.gguf`, llama.cpp's gguf-split): merged once into one file, which
everything else (layouts, windows, the repacked copy, the prefetcher, the model store) reads as it reads any GGUF.

The merge is llama.cpp's own: its quantizer copying every tensor as it is (`only_copy`), which reads the parts as
llama.cpp loads them and drops the split keys. The same parts give the same bytes on every device, so a head and a
node that merge the same model agree on its identity.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from primaplug.core.errors import ConfigError, EngineError
from primaplug.core.settings import usable_cores

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Progress = Callable[[float, str], None]


def split_parts(path: str | os.PathLike[str]) -> list[Path] | None:
    """The parts of the split model `path` is one of, in order (None for a model in one file). Every part must be
    there, beside it."""
    p = Path(path)
    m = SPLIT.match(p.name)
    if m is None:
        return None
    count = int(m["count"])
    parts = [p.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise ConfigError(f"{p.name} is part of a model in {count} files, and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not beside it in {p.parent}")
    return parts


def merge_parts(parts: list[Path], out: Path, progress: Progress | None = None) -> Path:
    """Write the model of `parts` as one GGUF at `out` (through a temporary file: an interrupted merge leaves none)."""
    from llama_cpp import llama_cpp as _ll

    from primaplug.engine import _log

    _log.install()
    total = sum(q.stat().st_size for q in parts)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    params = _ll.llama_model_quantize_default_params()
    params.only_copy = True
    params.nthread = usable_cores()
    done = threading.Event()

    def watch() -> None:  # llama.cpp's quantizer reports nothing while it copies: the file's growth says how far
        while not done.wait(0.5):
            if progress is not None and tmp.exists():
                progress(min(1.0, tmp.stat().st_size / total), f"merging the {len(parts)} parts of {parts[0].name} "
                         f"into one file (once): {tmp.stat().st_size / 2**30:.1f} of {total / 2**30:.1f} GiB")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code = _ll.llama_model_quantize(os.fspath(parts[0]).encode(), os.fspath(tmp).encode(), ctypes.byref(params))
    finally:
        done.set()
        watcher.join()
    if code != 0:
        tmp.unlink(missing_ok=True)
        raise EngineError(f"merging {parts[0].name} and its other parts failed: {_log.take_errors() or 'see the log'}",
                          code)
    os.replace(tmp, out)
    return out
