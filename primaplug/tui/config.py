"""Provides the cluster the dashboard remembers between runs: its nodes (or how many local ones), the keys file,
the model and the plan asked for, in `dashboard.json` under the user's config directory (core/settings.py).

A file that cannot be read is set aside with a warning, never a reason not to start.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from primaplug.core.settings import config_root

log = logging.getLogger(__name__)
FILE_NAME = "dashboard.json"


@dataclass
class Remembered:
    nodes: list[str] = field(default_factory=list)  # HOST:PORT of nodes started by hand
    local_nodes: int = 0  # nodes the dashboard starts on this machine
    discover: bool = False  # add the nodes of the cluster that advertise themselves (--nodes auto)
    keys: str | None = None  # the cluster key file
    model: str | None = None  # the GGUF file (None: the bundled model)
    scheduler: str = "halda"  # halda, memory, compute, even or manual
    rounds: int | None = None
    layers: list[int] = field(default_factory=list)  # the manual split
    gpu_layers: int = 0

    @classmethod
    def path(cls) -> Path:
        return config_root() / FILE_NAME

    @classmethod
    def load(cls, path: Path | None = None) -> Remembered:
        path = path or cls.path()
        try:
            data = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, TypeError) as e:
            log.warning("could not read the dashboard's last cluster from %s (%s); starting afresh", path, e)
            return cls()

    def save(self, path: Path | None = None) -> None:
        path = path or self.path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not remember the cluster in %s: %s", path, e)
