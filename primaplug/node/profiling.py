"""A node measuring itself for the planner: the device profiler in a background thread, so that the control
loop keeps answering (the first measurement takes seconds; later ones read the cache on the device)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from primaplug.core.profiles import DeviceProfile
from primaplug.engine import ModelLayout
from primaplug.profiler import model_types, profile_device, profile_model

log = logging.getLogger(__name__)


class Profiling:
    """One measurement at a time. `ask` starts one, or hands over the finished one (once: the next ask measures
    memory afresh, from the cached speeds)."""

    def __init__(self, name: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.name, self.cache_dir = name, cache_dir
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done: tuple[str, DeviceProfile | Exception] | None = None  # (model identity, result)

    def ask(self, path: Path | None, layout: ModelLayout, *, force: bool, shown: str | None = None
            ) -> tuple[DeviceProfile | None, str]:
        """(the profile, "") when one for this model is ready; else (None, what is being measured). A failed
        measurement is raised here. `path`: the model's file, whose reads time the disk (None: a file of the cache
        folder's is timed); `shown`: the model's name in messages (default: the path's)."""
        with self._lock:
            if self._done is not None and self._done[0] == layout.identity and not force:
                _, result = self._done
                self._done = None
                if isinstance(result, Exception):
                    raise result
                return result, ""
            if self._thread is None or not self._thread.is_alive():
                self._done = None
                self._thread = threading.Thread(target=self._measure, args=(path, layout, force), name="profile",
                                                daemon=True)
                self._thread.start()
        name = shown or (path.name if path else layout.identity)
        return None, f"measuring {self.name} for {name} (compute per quantization type, memory, disk)"

    def _measure(self, path: Path | None, layout: ModelLayout, force: bool) -> None:
        result: DeviceProfile | Exception
        try:
            model = profile_model(layout, n_ctx=512, n_batch=512, n_ubatch=512)  # its types and layer size
            result = profile_device(self.name, model_types=model_types(model), cache_dir=self.cache_dir, force=force,
                                    model_path=path, layer_bytes=model.layer_bytes)
        except Exception as e:  # a thread boundary: hand the failure to the head that asked
            log.exception("profiling failed")
            result = e
        with self._lock:
            self._done = (layout.identity, result)
