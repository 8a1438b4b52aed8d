"""A model file cut into pieces, and the hash of each: what a node fetches and checks.

The pieces follow the parts of the file a device reads (engine/layout.py's units): the header (metadata and tensor
table), then each run of tensors of one unit (a layer, the token embedding, the output layer, the rest), with the
padding after it, cut at PIECE_BYTES. They cover the file from its first byte to its last, so a node that fetched
every piece holds the file itself. A node computes the same cut from the header it fetched (piece_plan) and holds
the holder's manifest to it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from primaplug.core.errors import ConfigError, PrimaplugError
from primaplug.core.settings import cache_root
from primaplug.engine.layout import GLOBALS, INPUT, OUTPUT, ModelLayout, unit_tensors, units_for
from primaplug.wire import Manifest

log = logging.getLogger(__name__)

PIECE_BYTES = 4 * 2**20  # large enough that a request's round trip is small beside its transfer, small to retry
HEADER = "header"
IDENTITY = re.compile(r"\A[0-9]{1,20}:[0-9a-f]{32}\Z")  # ModelLayout.identity: size, then a hash of the header

Progress = Callable[[float, str], None]


class ManifestError(PrimaplugError):
    """A manifest that does not fit the model it names: its holder lies, or holds another file."""


@dataclass(frozen=True)
class Piece:
    offset: int
    length: int
    unit: str  # HEADER, or the engine's unit: "blk.N", INPUT, OUTPUT or GLOBALS


def check_identity(identity: str) -> str:
    """A model identity from the wire, refused unless it has ModelLayout.identity's form (it names files)."""
    if not IDENTITY.match(identity):
        raise ConfigError(f"'{identity[:80]}' is not a model identity (SIZE:HASH)")
    return identity


def _split(offset: int, end: int, unit: str) -> list[Piece]:
    return [Piece(o, min(PIECE_BYTES, end - o), unit) for o in range(offset, end, PIECE_BYTES)]


def piece_plan(layout: ModelLayout) -> list[Piece]:
    """The pieces of the layout's file, in file order."""
    unit_of: dict[str, str] = {}
    for unit in (GLOBALS, INPUT, OUTPUT):
        unit_of.update((t.name, unit) for t in unit_tensors(layout, unit))
    tensors = sorted(layout.tensors, key=lambda t: t.offset)
    first = tensors[0].offset if tensors else layout.file_size
    pieces = _split(0, first, HEADER)
    runs: list[tuple[int, str]] = []  # (start, unit) of each run of one unit's tensors
    for t in tensors:
        unit = f"blk.{t.layer}" if t.layer is not None else unit_of.get(t.name, GLOBALS)
        if not runs or runs[-1][1] != unit:
            runs.append((t.offset, unit))
    for i, (start, unit) in enumerate(runs):
        end = runs[i + 1][0] if i + 1 < len(runs) else layout.file_size
        pieces += _split(start, end, unit)
    return pieces


def needed_units(layout: ModelLayout, layers: Iterable[int], output: bool = False) -> set[str]:
    """The units a device running these layers fetches: those it reads (the engine's own rule, units_for) and the
    header, but not the token embedding for layer 0: a token reads one row of it, which the head sends with the
    token (head/embedding.py). A tied lm_head reads it whole."""
    units = {HEADER, *units_for(layout, layers, (), output)}
    return units if output and layout.output_tied else units - {INPUT}


def needed_pieces(layout: ModelLayout, layers: Iterable[int], output: bool = False) -> list[int]:
    """The indices of the pieces a device running these layers reads."""
    units = needed_units(layout, layers, output)
    return [i for i, p in enumerate(piece_plan(layout)) if p.unit in units]


def header_pieces(manifest: Manifest) -> list[int]:
    """The first pieces of a manifest, up to its header_bytes: the header, before the layout that cuts the rest is
    known."""
    return [i for i, o in enumerate(manifest.offsets) if o < manifest.header_bytes]


def check_manifest(manifest: Manifest, layout: ModelLayout) -> None:
    """Refuse a manifest whose pieces are not the layout's cut of its file."""
    plan = piece_plan(layout)
    if (manifest.model != layout.identity or manifest.file_size != layout.file_size
            or manifest.header_bytes != layout.data_offset
            or manifest.offsets != tuple(p.offset for p in plan) or manifest.lengths != tuple(p.length for p in plan)
            or len(manifest.sha256) != 32 * len(plan)):
        raise ManifestError(f"the manifest of {manifest.model} does not cut the model's file as its header says")


class _Cached(msgspec.Struct, frozen=True):
    stamp: tuple[int, int, int, int]  # device, inode, size, modification time (ns) of the file it was computed from
    manifest: bytes


def file_manifest(path: str | os.PathLike[str], layout: ModelLayout, *, cache_dir: Path | None = None,
                  progress: Progress | None = None) -> Manifest:
    """The manifest of a whole model file: each piece's hash, read from the file once (seconds a GB), then kept in
    the cache folder for as long as the file is unchanged."""
    folder = cache_dir or cache_root() / "manifests"
    size, digest = layout.identity.split(":")
    cached = folder / f"{digest}-{size}.manifest"
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            kept = msgspec.msgpack.decode(cached.read_bytes(), type=_Cached)
            if tuple(kept.stamp) == stamp:
                return msgspec.msgpack.decode(kept.manifest, type=Manifest)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass
        plan = piece_plan(layout)
        hashes, done, total = bytearray(), 0, max(1, layout.file_size)
        fd = f.fileno()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for p in plan:
            data = os.pread(fd, p.length, p.offset)
            if len(data) != p.length:
                raise ManifestError(f"{path} ended at byte {p.offset + len(data)}, before its header says")
            hashes += hashlib.sha256(data).digest()
            done += p.length
            if progress is not None and (10 * done // total != 10 * (done - p.length) // total):
                progress(done / total, f"hashing {os.path.basename(path)} for the nodes that fetch it: "
                         f"{done / 2**20:.0f} of {total / 2**20:.0f} MiB")
    manifest = Manifest(model=layout.identity, file_size=layout.file_size, piece_bytes=PIECE_BYTES,
                        offsets=tuple(p.offset for p in plan), lengths=tuple(p.length for p in plan),
                        sha256=bytes(hashes), header_bytes=layout.data_offset)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(msgspec.msgpack.encode(_Cached(stamp, msgspec.msgpack.encode(manifest))))
        os.replace(tmp, cached)
    except OSError as e:  # a read-only cache costs a hash at the next start, nothing else
        log.warning("could not keep the manifest of %s in %s: %s", path, folder, e)
    return manifest
