"""Each peer built once per source and commands: from a checkout given by path, by its own README's commands, or
(llama.cpp RPC) from the pinned sdist's vendored llama.cpp.

A checkout's build runs in a copy of its committed files (the checkout itself is left as it is; a snapshot may lack
its largest files, such as prima.cpp's vocabulary tests, which no build needs), and what it made is kept under the
cache, in a folder named for the peer, its source and a key over the source, any uncommitted change and the
commands. `build.json` there records them. A build that fails keeps nothing, and its log says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

OUT = "{out}"  # in a command: the folder the build's products go to (an install prefix, say)


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Source:
    """What a build starts from: `commit` says which source it is (`label`, short, names its folder), `digest` keys
    its content, `changed` lists files that differ from the commit, and `lay_out(tree)` puts the source at `tree`."""

    commit: str
    label: str
    digest: str
    lay_out: Callable[[Path], None]
    changed: list[str] = field(default_factory=list)


def _git(src: Path, *args: str) -> bytes:
    done = subprocess.run(["git", "-C", str(src), *args], capture_output=True)
    if done.returncode != 0:
        raise BuildError(f"git {args[0]} failed in {src} ({done.stderr.decode(errors='replace').strip()}): give a "
                         "clone of the peer's public repository")
    return done.stdout


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's own object id


def _read(f: Path, mode: str) -> bytes:
    return os.readlink(f).encode() if mode == "120000" else f.read_bytes()


def _tree(src: Path) -> list[tuple[str, str, str]]:
    """(mode, path, blob id) of each file of the commit checked out."""
    rows = []
    for line in _git(src, "ls-tree", "-r", "-z", "HEAD").decode(errors="surrogateescape").split("\0"):
        if line:
            meta, name = line.split("\t", 1)
            mode, kind, blob = meta.split()
            if kind == "blob":
                rows.append((mode, name, blob))
    return rows


def source_key(src: Path) -> tuple[str, str, list[str]]:
    """The checkout's commit; a digest of it with every change to its files; the files changed. The files are those
    of the commit's tree (not of the index, which a snapshot's checkout may lack); a file missing from the checkout
    is no change (copy_tracked leaves it out, and a snapshot may lack its largest files)."""
    commit = _git(src, "rev-parse", "HEAD").decode().strip()
    digest, changed = hashlib.sha256(commit.encode()), []
    for mode, name, blob in _tree(src):
        f = src / name
        if (f.is_symlink() or f.is_file()) and _blob_id(data := _read(f, mode)) != blob:
            changed.append(name)
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return commit, digest.hexdigest(), changed


def checkout(src: Path) -> Source:
    """A git checkout as a build's source: its committed files as they are in it."""
    commit, digest, changed = source_key(src)
    return Source(commit, commit[:12], digest, lambda tree: copy_tracked(src, tree), changed)


def copy_tracked(src: Path, dest: Path) -> None:
    """The files of the commit checked out that are present, into `dest` (no build products, no untracked files)."""
    for mode, name, _ in _tree(src):
        f, to = src / name, dest / name
        if f.is_symlink() or f.is_file():
            to.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                to.symlink_to(os.readlink(f))
            else:
                shutil.copy2(f, to)


def cached(name: str, source: Source, commands: list[list[str]], products: dict[str, str], cache: Path, log: Path,
           expect: tuple[str, ...] = (), notes: dict[str, str] | None = None) -> Path:
    """Build `name` from `source` once: `commands` run in a copy of it (`{out}` in them is the output folder), then
    each of `products` (a path in the copy: its path in the output folder) is copied out. Returns the output folder,
    where every product and each of `expect` exist. `notes` are recorded with the build."""
    key = hashlib.sha256((source.digest + json.dumps([commands, products])).encode()).hexdigest()[:12]
    out = cache / f"{name}-{source.label}-{key}"
    wanted = [*products.values(), *expect]
    if out.is_dir() and all((out / p).exists() for p in wanted):
        return out
    print(f"peers: building {name} from {source.commit} (once, several minutes; log {log})", file=sys.stderr,
          flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tempfile.TemporaryDirectory() as tmp, open(log, "w") as lf:
            tree = Path(tmp) / name
            source.lay_out(tree)
            for cmd in commands:
                argv = [a.replace(OUT, str(staging)) for a in cmd]
                lf.write(f"$ {' '.join(argv)}\n")
                lf.flush()
                if subprocess.run(argv, cwd=tree, stdout=lf, stderr=subprocess.STDOUT, env=_parallel()).returncode:
                    raise BuildError(f"building {name} failed at `{' '.join(cmd)}`: see {log}")
            for inside, target in products.items():
                (staging / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / inside, staging / target)
        lacking = [p for p in wanted if not (staging / p).exists()]
        if lacking:
            raise BuildError(f"building {name} made no {', '.join(lacking)}: see {log}")
        (staging / "build.json").write_text(json.dumps({"commit": source.commit, "uncommitted": source.changed,
                                                        "commands": commands} | (notes or {}), indent=1))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def recorded(out: Path) -> dict[str, object]:
    """What `cached` recorded of a build: its commit, the files the checkout had changed, its commands and its
    notes."""
    return json.loads((out / "build.json").read_text())


def summary(out: Path) -> dict[str, str]:
    """A build's commit and commands, as the results record them."""
    done = recorded(out)
    changed = done["uncommitted"]
    return {"commit": str(done["commit"]) + (f" with uncommitted changes to {len(changed)} file(s)"  # type: ignore[arg-type]
                                             if changed else ""),
            "flags": " ; ".join(" ".join(c) for c in done["commands"])}  # type: ignore[union-attr]


def _parallel() -> dict[str, str]:
    """Every core for make and CMake's builds, set apart from the commands, which name the build, not the machine."""
    n = str(os.cpu_count() or 2)
    return os.environ | {"MAKEFLAGS": f"-j{n}", "CMAKE_BUILD_PARALLEL_LEVEL": n}
