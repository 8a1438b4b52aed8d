"""The model files a node holds: each opened once when the node starts, and afterwards read only through that open
file, never through the name it was given.

Re-pointing a symlink (or renaming another file onto the name) after the start must not make the next load open
another file: a node would otherwise map whatever the name now names, and the error of a failed load could quote
that file's first bytes to the head. On Linux and Android every reader (the header, llama.cpp's own open and
mapping, the repacked copy's build, the prefetcher's advice, the profiler's disk reads) is given /proc/self/fd/N,
which opens the held file itself whatever its name now says. Elsewhere the name is used, checked against the held
file (device and inode) before and after each load. The bytes of the held file can still be written in place: its
size and modification time are checked too, and a changed file is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from primaplug.core.errors import ConfigError, PrimaplugError
from primaplug.memory.system import fd_path


class ModelFileChangedError(PrimaplugError):
    """The model file a node holds changed since the node started; the message says how, never what it holds."""


class HeldFile:
    """One model file, open for the node's lifetime. `path` names the held file for every reader."""

    def __init__(self, given: Path) -> None:
        self.given = given
        try:
            fd = os.open(given, os.O_RDONLY)
        except OSError as e:
            raise ConfigError(f"cannot open model file {given}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ConfigError(f"model file {given} is not a regular file")
        self.fd = fd
        self._stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.path = fd_path(fd, st) or os.fspath(given)
        self.by_fd = self.path != os.fspath(given)

    @property
    def name(self) -> str:
        return self.given.name

    def problem(self) -> str:
        """Why the file may not be read now ("" when it may): it was written, or (where readers go by name) its
        name now points at another file. Says nothing of what the file holds."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self._stamp[2:]:
            return (f"model file {self.given} was written since this node started (size or modification time "
                    "changed): restart the node to serve the new file")
        if not self.by_fd:
            try:
                now = os.stat(self.given)
            except OSError as e:
                return f"model file {self.given} cannot be read any more ({e.strerror}): restart the node"
            if (now.st_dev, now.st_ino) != self._stamp[:2]:
                return (f"model file {self.given} now names another file than the one this node checked at start: "
                        "restart the node to serve it")
        return ""

    def check(self) -> None:
        problem = self.problem()
        if problem:
            raise ModelFileChangedError(problem)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
