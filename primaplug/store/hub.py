"""Where the head's copy of a model comes from: a file here, a Hugging Face reference fetched once through
huggingface_hub (its cache, its progress bars, HF_ENDPOINT and HF_TOKEN as it reads them), and a model in several
files merged into one (engine/splits.py), kept in primaplug's cache.

    -m model.gguf                      a file
    -m hf://ORG/REPO/PATH/FILE.gguf    one file of a repository (every part, for a model in several files)
    -m ORG/REPO:QUANT                  the repository's one model whose file name holds QUANT (Q4_K_M, ...)
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primaplug.core.errors import ConfigError
from primaplug.core.settings import cache_root
from primaplug.engine.splits import SPLIT, merge_parts, split_parts

log = logging.getLogger(__name__)

HF = "hf://"
REPO_QUANT = re.compile(r"\A(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<quant>[\w.-]+)\Z")

Progress = Callable[[float, str], None]


def resolve_model(ref: str | os.PathLike[str], progress: Progress | None = None) -> Path:
    """The local GGUF file a model reference names: downloaded first where it is on the Hub, merged first where
    it is in several files."""
    text = os.fspath(ref)
    if text.startswith(HF):
        path = _download_file(text)
    elif not os.path.exists(text) and (m := REPO_QUANT.match(text)):
        path = _download_quant(m["repo"], m["quant"])
    else:
        path = Path(text)
    parts = split_parts(path)
    return merged(parts, progress) if parts else path


def merged(parts: list[Path], progress: Progress | None = None) -> Path:
    """The one-file copy of a model in several parts, made once in the cache (named for the parts' names, sizes and
    times: a changed part makes another)."""
    key = hashlib.sha256(repr([(q.name, q.stat().st_size, q.stat().st_mtime_ns) for q in parts]).encode())
    m = SPLIT.match(parts[0].name)
    assert m is not None
    out = cache_root() / "merged" / f"{m['stem']}-{key.hexdigest()[:16]}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("merging the %d parts of %s into %s (once)", len(parts), parts[0].name, out)
        merge_parts(parts, out, progress)
    return out


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError("a Hugging Face model reference needs huggingface_hub: pip install 'primaplug[hf]' "
                          "(or download the file and pass its path)") from None
    return huggingface_hub


def _fetch(repo: str, filenames: list[str]) -> Path:
    """Download files of a repository (each once: huggingface_hub's cache); the first one's local path."""
    hub = _hub()
    paths = []
    for name in filenames:
        try:
            paths.append(Path(hub.hf_hub_download(repo_id=repo, filename=name)))
        except Exception as e:  # huggingface_hub's errors (not found, gated, offline) and the network's
            raise ConfigError(f"could not download {name} from the Hugging Face repository {repo}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return paths[0]


def _parts_of(name: str) -> list[str]:
    """A file's name and those of its other parts, for a model in several files."""
    m = SPLIT.match(Path(name).name)
    if m is None:
        return [name]
    folder = name[: len(name) - len(Path(name).name)]
    count = int(m["count"])
    return [f"{folder}{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _download_file(ref: str) -> Path:
    org, _, rest = ref[len(HF):].partition("/")
    repo, _, name = rest.partition("/")
    if not org or not repo or not name.endswith(".gguf"):
        raise ConfigError(f"{ref}: a Hugging Face file is named hf://ORG/REPO/FILE.gguf")
    return _fetch(f"{org}/{repo}", _parts_of(name))


def _download_quant(repo: str, quant: str) -> Path:
    hub = _hub()
    try:
        files = hub.list_repo_files(repo)
    except Exception as e:  # huggingface_hub's errors (not found, gated, offline) and the network's
        raise ConfigError(f"could not list the Hugging Face repository {repo}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    models: dict[str, str] = {}  # a model (a single file, or the first part of several) -> its file
    for f in files:
        if f.endswith(".gguf") and quant.lower() in Path(f).name.lower():
            first = _parts_of(f)[0]
            models.setdefault(first, first)
    if len(models) != 1:
        found = ", ".join(sorted(models)) or "none"
        raise ConfigError(f"{repo}:{quant} names {len(models)} GGUF models in the repository ({found}): name one "
                          f"with hf://{repo}/FILE.gguf")
    return _fetch(repo, _parts_of(next(iter(models))))
