"""Termux's wake lock round a node's life (`primaplug node --wake-lock`; docs/platforms.md).

With the screen off Android suspends the CPU, and with it the node, unless an app holds a wake lock. Termux's
`termux-wake-lock` (termux-tools, in every Termux install) asks its service to hold a partial wake lock and a
high-performance Wi-Fi lock, and `termux-wake-unlock` lets them go. They are Termux's, not the process's: one
lock for the whole app, so a node started with the lock already held still releases it when it stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

from primaplug.core.errors import ConfigError
from primaplug.core.settings import DEFAULT_WAKE_LOCK, WAKE_LOCK_MODES
from primaplug.memory.android import is_termux

log = logging.getLogger(__name__)

LOCK, UNLOCK = "termux-wake-lock", "termux-wake-unlock"
TIMEOUT_S = 30.0  # `am startservice` can take seconds on an old phone
MISSING = (f"{LOCK} not found in $PREFIX/bin or on PATH: it comes with Termux's termux-tools "
           f"(pkg install termux-tools)")

Run = Callable[..., "subprocess.CompletedProcess[str]"]


def find_command(name: str, env: Mapping[str, str]) -> str | None:
    """The command on env's PATH, else in $PREFIX/bin (Termux's), or None."""
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found:
        return found
    prefix = env.get("PREFIX") or env.get("TERMUX__PREFIX")
    candidate = Path(prefix, "bin", name) if prefix else None
    return str(candidate) if candidate and os.access(candidate, os.X_OK) else None


class WakeLock:
    """Takes Termux's wake lock on enter (or acquire()) and releases it on exit (or release()).

    mode "auto": only under Termux, and a missing command is a warning; "on": required, and a missing command or
    a refusal is a ConfigError; "off": nothing."""

    def __init__(self, mode: str = DEFAULT_WAKE_LOCK, env: Mapping[str, str] | None = None,
                 run: Run = subprocess.run) -> None:
        if mode not in WAKE_LOCK_MODES:
            raise ConfigError(f"--wake-lock must be one of {', '.join(WAKE_LOCK_MODES)}, not {mode!r}")
        self.mode = mode
        self.env = dict(os.environ if env is None else env)
        self.run = run
        self.held = False

    def wanted(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and is_termux(self.env))

    def acquire(self) -> bool:
        """Take the lock if this mode wants it; whether it is held now."""
        if not self.wanted():
            return False
        command = find_command(LOCK, self.env)
        if command is None:
            if self.mode == "on":
                raise ConfigError(f"--wake-lock on: {MISSING}. Outside Termux there is no wake lock to take: "
                                  "use --wake-lock off")
            log.warning("%s; without the wake lock Android may suspend this node when the screen turns off", MISSING)
            return False
        problem = self._call(command)
        if problem:
            if self.mode == "on":
                raise ConfigError(f"--wake-lock on: {problem}")
            log.warning("%s; the node runs without it, and may stop when the screen turns off", problem)
            return False
        self.held = True
        log.info("holding Termux's wake lock (%s): the CPU and Wi-Fi stay up with the screen off, until the node "
                 "stops", LOCK)
        return True

    def release(self) -> None:
        """Let the lock go if this node took it; a failure is logged, never raised (the node is stopping)."""
        if not self.held:
            return
        self.held = False
        command = find_command(UNLOCK, self.env)
        problem = self._call(command) if command else f"{UNLOCK} not found"
        if problem:
            log.warning("could not release Termux's wake lock (%s): run %s by hand", problem, UNLOCK)
        else:
            log.info("released Termux's wake lock")

    def _call(self, command: str) -> str:
        """Run a wake lock command: "" when it worked, else what went wrong. termux-wake-lock exits 0 even when
        `am` fails, saying so on stderr."""
        name = Path(command).name
        try:
            r = self.run([command], capture_output=True, text=True, timeout=TIMEOUT_S, env=self.env, check=False)
        except subprocess.TimeoutExpired:
            return f"{name} did not return within {TIMEOUT_S:g} s"
        except OSError as e:
            return f"{name} could not run: {e}"
        said = " ".join((r.stderr or "").split())
        if r.returncode != 0 or said.lower().startswith("failed"):
            return f"{name} failed (exit {r.returncode}){': ' + said if said else ''}"
        return ""

    def __enter__(self) -> WakeLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
