"""Start `primaplug node` daemons on this machine as child processes, and always reap them.

Used by `primaplug run --local-nodes N` (the README's main command) and by the tests. Each node listens on
random loopback ports and prints one `ready` line with its addresses, which is how the launcher learns them.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from primaplug.core.errors import PrimaplugError

READY = re.compile(r"^primaplug node (\S+) ready: control (tcp://\S+):(\d+) ring (\S+)$")


class LocalNode:
    def __init__(self, proc: subprocess.Popen[str], name: str, address: str, ring: str, log_path: Path) -> None:
        self.proc, self.name, self.address, self.ring, self.log_path = proc, name, address, ring, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class LocalNodes:
    """N node processes on loopback; `with LocalNodes(...) as nodes:` stops and reaps them all on exit."""

    def __init__(self, model: str | os.PathLike[str], n: int, *, log_dir: str | os.PathLike[str],
                 extra_args: Sequence[str] = (), start_timeout_s: float = 60.0) -> None:
        self.model, self.n = Path(model), n
        self.log_dir = Path(log_dir)
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.nodes: list[LocalNode] = []

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def start(self) -> list[LocalNode]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        procs = []
        for i in range(self.n):
            name = f"node{i + 1}"
            log_path = self.log_dir / f"{name}.log"
            cmd = [sys.executable, "-m", "primaplug", "node", "--model", str(self.model), "--listen", "127.0.0.1:0",
                   "--name", name, *self.extra_args]
            with open(log_path, "w") as err:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            procs.append((proc, name, log_path))
        try:
            for proc, name, log_path in procs:
                self.nodes.append(self._await_ready(proc, name, log_path))
        except BaseException:
            for proc, _, _ in procs:
                _kill(proc)
            raise
        return self.nodes

    def _await_ready(self, proc: subprocess.Popen[str], name: str, log_path: Path) -> LocalNode:
        assert proc.stdout is not None
        # the node prints exactly one line when it listens, or exits
        ready, _, _ = select.select([proc.stdout], [], [], self.start_timeout_s)
        line = proc.stdout.readline() if ready else ""
        m = READY.match(line.strip())
        if not m:
            _kill(proc)
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise PrimaplugError(f"local node {name} did not start (exit code {proc.poll()}):\n{tail}")
        host = m.group(2).removeprefix("tcp://").strip("[]")
        return LocalNode(proc, name, f"{host}:{m.group(3)}", m.group(4), log_path)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every node, wait, SIGKILL what is left; no zombie stays behind."""
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for n in self.nodes:
            try:
                n.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(n.proc)
            if n.proc.stdout:
                n.proc.stdout.close()

    def __enter__(self) -> LocalNodes:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
