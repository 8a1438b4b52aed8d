"""Start `primaplug node` daemons on this machine as child processes, and always reap them.

Used by `primaplug run --local-nodes N` (the README's main command) and by the tests. Each node listens on
random loopback ports and prints one `ready` line with its addresses, which is how the launcher learns them.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from primaplug.core.errors import PrimaplugError
from primaplug.memory.system import linux_kernel

READY = re.compile(r"^primaplug node (\S+) ready: control (tcp://\S+):(\d+) ring (\S+)$")


class LocalNode:
    def __init__(self, proc: subprocess.Popen[str], name: str, address: str, ring: str, log_path: Path) -> None:
        self.proc, self.name, self.address, self.ring, self.log_path = proc, name, address, ring, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _reason(log: str) -> str:
    """A node's own account of why it stopped: its error line (argparse's and primaplug's `primaplug: error: ...`),
    else the last line of a traceback, else nothing."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("primaplug: error:"):
            return line.removeprefix("primaplug: error:").strip()
    return lines[-1] if lines and "Error" in lines[-1] else ""


class LocalNodes:
    """N node processes on loopback; `with LocalNodes(...) as nodes:` stops and reaps them all on exit.

    `model` is one file for every node, or one per node (emulated devices need their own copies, or they share
    the page cache). `node_args` adds flags per node, and `preexec` runs in each child before it starts
    (an emulated device moves itself into its cgroup there, so that all its memory is charged to it).
    """

    def __init__(self, model: str | os.PathLike[str] | Sequence[str | os.PathLike[str] | None], n: int, *,
                 log_dir: str | os.PathLike[str], extra_args: Sequence[str] = (),
                 node_args: Sequence[Sequence[str]] | None = None,
                 preexec: Sequence[Callable[[], None] | None] | None = None,
                 names: Sequence[str] | None = None, start_timeout_s: float = 60.0) -> None:
        models = [model] * n if isinstance(model, (str, os.PathLike)) else list(model)
        for what, seq in (("model", models), ("node_args", node_args), ("preexec", preexec), ("names", names)):
            if seq is not None and len(seq) != n:
                raise PrimaplugError(f"LocalNodes: {n} nodes but {len(seq)} {what} entries")
        self.models, self.n = [Path(m) if m is not None else None for m in models], n
        self.log_dir = Path(log_dir)
        self.extra_args = list(extra_args)
        self.node_args = [list(a) for a in node_args] if node_args else [[] for _ in range(n)]
        self.preexec = list(preexec) if preexec else [None] * n
        self.names = list(names) if names else [f"node{i + 1}" for i in range(n)]
        self.start_timeout_s = start_timeout_s
        self.nodes: list[LocalNode] = []
        self._spawned: list[tuple[subprocess.Popen[str], str, Path]] = []

    @property
    def model(self) -> Path | None:
        return self.models[0]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def start(self) -> list[LocalNode]:
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the processes without waiting for them. On Linux a node is stopped when the thread that started it
        ends (PR_SET_PDEATHSIG), so spawn from a thread that lives as long as the nodes should: the main one."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        procs = []
        for i in range(self.n):
            name = self.names[i]
            log_path = self.log_dir / f"{name}.log"
            model = ["--model", str(self.models[i])] if self.models[i] is not None else []  # None: it fetches
            cmd = [sys.executable, "-m", "primaplug", "node", *model, "--listen", "127.0.0.1:0", "--name", name,
                   "--exit-with-parent", *self.extra_args, *self.node_args[i]]
            with open(log_path, "w") as err:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                        preexec_fn=_child_setup(self.preexec[i]))
            procs.append((proc, name, log_path))
        self._spawned = procs

    def wait_ready(self) -> list[LocalNode]:
        """Wait until every spawned node listens (any thread may wait); on a failure, stop them all."""
        try:
            for proc, name, log_path in self._spawned:
                self.nodes.append(self._await_ready(proc, name, log_path))
        except BaseException:
            for proc, _, _ in self._spawned:
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
            code = proc.poll()
            how = exit_status(code) if code is not None else "did not say it was ready in time"
            why = _reason(tail)
            raise PrimaplugError(f"local node {name} did not start{': ' + why if why else ''} (it {how}; its log: "
                                 f"{log_path})\n{tail}")
        host = m.group(2).removeprefix("tcp://").strip("[]")
        return LocalNode(proc, name, f"{host}:{m.group(3)}", m.group(4), log_path)

    def exits(self, tail_lines: int = 5) -> list[str]:
        """One paragraph per node that has exited while it should run: its exit status (the signal that killed it,
        by name), its log's path and the log's last lines. Empty while every node runs."""
        out = []
        for proc, name, log_path in self._spawned:
            code = proc.poll()
            if code is None:
                continue
            tail = (log_path.read_text(errors="replace").rstrip().splitlines() if log_path.exists() else [])
            out.append(f"local node {name} (pid {proc.pid}) {exit_status(code)}; its log: {log_path}"
                       + "".join(f"\n    {line}" for line in tail[-tail_lines:]))
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every node, wait, SIGKILL what is left; no zombie stays behind."""
        procs = [p for p, _, _ in self._spawned]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(proc)
            if proc.stdout:
                proc.stdout.close()

    def __enter__(self) -> LocalNodes:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def exit_status(code: int) -> str:
    """A process's exit in words: "exited with status 1", or "was killed by SIGSEGV" (Popen's negative codes)."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _child_setup(then: Callable[[], None] | None) -> Callable[[], None]:
    """Runs in each node child before exec: on Linux's kernel (Android's too) the node gets SIGTERM when its
    launcher dies, even by SIGKILL, so no node outlives the process that started it; then the caller's own setup.
    Elsewhere, and should the launcher die before the child asked for that signal, the node's --exit-with-parent
    sees its parent change and stops."""
    pdeathsig = linux_kernel()
    launcher = os.getpid()

    def setup() -> None:
        if pdeathsig:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != launcher:  # it died before the line above: no signal will come
                os._exit(1)
        if then is not None:
            then()

    return setup


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
