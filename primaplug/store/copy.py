"""Sparse copies of model files in a node's model folder, within a disk budget.

A copy is the model's file at its full size with holes where the node fetched nothing (a hole takes no disk and
reads as zeros), and a record of the pieces it holds and when each was last used. Names come from the model's
identity, never from a peer: `<hash>-<size>.gguf` and `<hash>-<size>.pieces`, opened without following links, so a
node writes nowhere but its folder. Pieces it no longer runs stay while the budget allows and go oldest first
(their bytes handed back to the file system: fallocate's punch-hole).

The layers a node runs on its CPU are repacked in the copy itself (engine/repacked.py: repack_in_place), so they
take disk once. The copy's record says which; reading a piece for a peer or for a check undoes the repacking
(engine/unrepack.py), so what leaves the copy is always the file's bytes, held to the manifest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from primaplug.core.errors import ConfigError, ModelFormatError, PrimaplugError, ProtocolError
from primaplug.engine import ModelLayout, TensorSpan, read_layout
from primaplug.engine.layout import INPUT, unit_tensors
from primaplug.memory.system import fd_path
from primaplug.store.manifest import IDENTITY, Piece, check_identity, check_manifest, piece_plan
from primaplug.wire import Manifest

log = logging.getLogger(__name__)

FREE_MARGIN_BYTES = 2**30  # a budget left to the default (the disk's free space) leaves this much free
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class DiskBudgetError(PrimaplugError):
    """The pieces a node must hold do not fit in its disk budget."""


class _Record(msgspec.Struct):
    file_name: str  # the head's name for the file, for people
    manifest: bytes  # the Manifest, encoded as it came (its digest is the head's word for it)
    held: dict[int, float]  # piece index -> Unix time it was last written or loaded
    forms: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)  # units repacked in place (RepackedForms)


def _stem(identity: str) -> str:
    size, digest = check_identity(identity).split(":")
    return f"{digest}-{size}"


class SparseCopy:
    """One model's copy in a folder: which pieces it holds, writing and reading them, dropping them."""

    def __init__(self, folder: Path, manifest: Manifest, file_name: str, held: dict[int, float] | None = None,
                 forms: dict[str, dict[str, str]] | None = None) -> None:
        self.manifest, self.file_name = manifest, file_name
        self.forms: dict[str, dict[str, str]] = dict(forms or {})  # units repacked in place: tensor -> layout key
        self.rows: set[int] = set()  # token embedding rows written since the process started (write_rows)
        # held while a layer's form changes (repacked in place, or put back) and while a piece is read for a peer,
        # so that a peer never reads a layer half rewritten
        self.lock = threading.RLock()
        self._pieces: list[Piece] | None = None  # the layout's cut (piece_plan), once the header is read
        self._embd: tuple[TensorSpan | None, list[int]] | None = None  # the token embedding, and its pieces
        self.path = folder / f"{_stem(manifest.model)}.gguf"
        self._record_path = self.path.with_suffix(".pieces")
        self.held: dict[int, float] = dict(held or {})
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(self.fd).st_size != manifest.file_size:
                os.ftruncate(self.fd, manifest.file_size)
        except OSError:
            os.close(self.fd)
            raise
        # readers (llama.cpp, the prefetcher) open the file held here, whatever its name names (node/files.py)
        self.reader_path = fd_path(self.fd, os.fstat(self.fd)) or str(self.path)
        self._verified: set[int] = set()  # pieces hashed by this process since the file last changed
        self._stamp = self._now_stamp()
        self._layout: ModelLayout | None = None

    @property
    def identity(self) -> str:
        return self.manifest.model

    def _now_stamp(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_size, st.st_mtime_ns

    # --- what it holds ----------------------------------------------------------------------------------------

    def holds(self, index: int) -> bool:
        return index in self.held

    def missing(self, indices: Iterable[int]) -> list[int]:
        return [i for i in indices if i not in self.held]

    def bytes_of(self, indices: Iterable[int]) -> int:
        return sum(self.manifest.lengths[i] for i in indices)

    @property
    def held_bytes(self) -> int:
        return self.bytes_of(self.held)

    def disk_bytes(self) -> int:
        """What the copy takes on disk (its holes take nothing)."""
        return os.fstat(self.fd).st_blocks * 512

    def held_units(self) -> tuple[str, ...]:
        """The units (engine/layout.py) whose every piece it holds; none before its header is."""
        try:
            plan = self.pieces()
        except (PrimaplugError, OSError):
            return ()
        units: dict[str, bool] = {}
        for i, p in enumerate(plan):
            units[p.unit] = units.get(p.unit, True) and i in self.held
        return tuple(u for u, whole in units.items() if whole)

    def layout(self) -> ModelLayout:
        """The model's layout, read from the copy's header (which must be held), held to its identity and manifest."""
        if self._layout is None:
            try:
                layout = read_layout(self.reader_path)
            except ModelFormatError as e:
                raise ModelFormatError(self.file_name, e.reason) from None
            if layout.identity != self.identity:
                raise ModelFormatError(self.file_name, f"its fetched header names model {layout.identity}, not "
                                       f"{self.identity}")
            check_manifest(self.manifest, layout)
            self._layout = layout
            self._check_forms()
        return self._layout

    def pieces(self) -> list[Piece]:
        """The layout's cut of the file into pieces (piece_plan), computed once."""
        if self._pieces is None:
            self._pieces = piece_plan(self.layout())
        return self._pieces

    def _check_forms(self) -> None:
        """Forget the units repacked in place under a layout this engine does not undo (another engine or CPU
        repacked them): their pieces are fetched again."""
        from primaplug.engine.unrepack import layout_for

        layout = self.layout()
        stale = [u for u, tensors in self.forms.items() for t in unit_tensors(layout, u)
                 if t.name in tensors and ((lay := layout_for(t)) is None or lay.key != tensors[t.name])]
        if stale:
            log.warning("%s: %d layer(s) were repacked by another engine or CPU; fetching them again",
                        self.file_name, len(set(stale)))
            for u in set(stale):
                del self.forms[u]
            self.drop([i for i, p in enumerate(self.pieces()) if p.unit in stale])

    # --- the token embedding's rows, sent by the head with the tokens (head/embedding.py) ---------------------

    def _embedding(self) -> TensorSpan | None:
        """The token embedding, when the copy does not hold it whole (its rows come one by one). Asked every token:
        the embedding and its pieces are found once."""
        if self._embd is None:
            self._embd = (self.layout().tensor("token_embd.weight"),
                          [i for i, p in enumerate(self.pieces()) if p.unit == INPUT])
        t, pieces = self._embd
        return None if t is None or all(i in self.held for i in pieces) else t

    def write_rows(self, ids: Sequence[int], data: bytes | memoryview) -> None:
        """Store the token embedding's rows of these ids, as the head's file holds them."""
        t = self._embedding()
        if t is None:
            return
        n_vocab = t.shape[1]
        row = t.nbytes // n_vocab
        if len(data) != row * len(ids) or not all(0 <= i < n_vocab for i in ids):
            raise ProtocolError(f"{len(data)} bytes of embedding rows for {len(ids)} token(s): this model's rows are "
                                f"{row} bytes, its tokens 0..{n_vocab - 1}")
        mv = memoryview(data)
        for k, i in enumerate(ids):
            os.pwrite(self.fd, mv[k * row:(k + 1) * row], t.offset + i * row)
        self.rows.update(ids)
        self._stamp = self._now_stamp()

    def lacks_rows(self, ids: Iterable[int]) -> list[int]:
        """The tokens among `ids` whose embedding row the copy has not been sent."""
        if self._embedding() is None:
            return []
        return sorted({int(i) for i in ids} - self.rows)

    # --- writing, reading, checking -------------------------------------------------------------------------

    def write(self, index: int, data: bytes) -> None:
        """Store a verified piece (the caller checked it against the manifest)."""
        os.pwrite(self.fd, data, self.manifest.offsets[index])
        self.held[index] = time.time()
        self._verified.add(index)
        self._stamp = self._now_stamp()

    def read(self, index: int) -> bytes:
        """A piece it holds as the model file has it, for a peer or a check."""
        with self.lock:
            return self._read(index)

    def _read(self, index: int) -> bytes:
        offset = self.manifest.offsets[index]
        data = os.pread(self.fd, self.manifest.lengths[index], offset)
        unit = self.pieces()[index].unit if self.forms else ""
        tensors = self.forms.get(unit)
        if not tensors:  # held as the file has it (a piece is one unit's)
            return data
        from primaplug.engine.unrepack import layout_for, undo_range

        raw: bytearray | None = None
        end = offset + len(data)
        for span in unit_tensors(self.layout(), unit):
            if span.name not in tensors or span.end <= offset or span.offset >= end:
                continue
            lay = layout_for(span)
            if lay is None or lay.key != tensors[span.name]:  # _check_forms dropped those: the hash fails, as it should
                continue
            a, b = max(offset, span.offset), min(end, span.end)
            if raw is None:
                raw = bytearray(data)
            raw[a - offset:b - offset] = undo_range(span, lay, self._pread, a, b).tobytes()
        return data if raw is None else bytes(raw)

    def _pread(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def save(self) -> None:
        """Write the record of what it holds (after the pieces' bytes are on the disk, so that a crash never
        leaves a record of bytes that are not)."""
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(self.fd)
        self._stamp = self._now_stamp()  # its own writes (pieces, repacking in place) need no check again
        tmp = self._record_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(msgspec.msgpack.encode(_Record(self.file_name, msgspec.msgpack.encode(self.manifest),
                                                       self.held, self.forms)))
        os.replace(tmp, self._record_path)

    def verify(self, indices: Iterable[int]) -> list[int]:
        """Hash the held pieces among `indices` that this process has not hashed since the file last changed
        (written by another hand, or its disk flipped a bit); drop those that do not match. Returns them."""
        if self._now_stamp() != self._stamp:
            self._verified.clear()
            self._stamp = self._now_stamp()
        bad = []
        for i in indices:
            if i not in self.held or i in self._verified:
                continue
            if hashlib.sha256(self.read(i)).digest() != self.manifest.piece_sha256(i):
                bad.append(i)
            else:
                self._verified.add(i)
        if bad:
            log.warning("%s: %d piece(s) (%.1f MiB) no longer match their hash; fetching them again",
                        self.file_name, len(bad), self.bytes_of(bad) / 2**20)
            self.drop(bad)
        return bad

    def touch(self, indices: Iterable[int]) -> None:
        now = time.time()
        for i in indices:
            if i in self.held:
                self.held[i] = now

    def drop(self, indices: Iterable[int]) -> None:
        """Forget these pieces and hand their bytes back to the file system. A layer repacked in place that loses a
        piece is first put back as the file has it, so that the pieces it keeps and those fetched again agree."""
        with self.lock:
            self._drop(list(indices))

    def _drop(self, indices: list[int]) -> None:
        if self.forms:
            from primaplug.engine.repacked import undo_in_place

            try:
                layout = self.layout()
            except (PrimaplugError, OSError):  # its header is gone: nothing says where its layers are; drop them all
                self.forms.clear()
                indices = [i for i in self.held if self.manifest.offsets[i] >= self.manifest.header_bytes] + indices
            else:
                plan, going = self.pieces(), set(indices)
                for unit in {plan[i].unit for i in indices} & set(self.forms):
                    tensors = self.forms.pop(unit)
                    if any(plan[i].unit == unit for i in self.held if i not in going):  # some of it stays
                        undo_in_place(layout, self.fd, unit, tensors)
                    self.save()
        for i in indices:
            if self.held.pop(i, None) is not None:
                _punch(self.fd, self.manifest.offsets[i], self.manifest.lengths[i])
            self._verified.discard(i)
        self.save()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Store:
    """A node's model folder: its sparse copies, by model identity, and the disk budget they share."""

    def __init__(self, folder: Path, budget_bytes: int | None = None) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot use {folder} as the model folder: {e.strerror}") from None
        self.folder = folder.resolve()
        # one node a folder: two would write the same copies and records
        self._lock = open(self.folder / ".lock", "a")  # noqa: SIM115 (held for the store's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ConfigError(f"another node uses {self.folder} as its model folder: give each node its own "
                              "--model-dir") from None
        self.copies: dict[str, SparseCopy] = {}
        for record in sorted(self.folder.glob("*.pieces")):
            copy = self._open(record)
            if copy is not None:
                self.copies[copy.identity] = copy
        if budget_bytes is None:  # what the disk has free now, less a margin, plus what the copies hold already
            free = shutil.disk_usage(self.folder).free
            budget_bytes = max(0, free - FREE_MARGIN_BYTES) + self.held_bytes
            if budget_bytes == 0:
                self.close()
                raise ConfigError(f"the disk of the model folder {self.folder} has {free / 2**20:.0f} MiB free, and "
                                  f"a node leaves {FREE_MARGIN_BYTES >> 20} MiB of it free by default: free some "
                                  "space, or give the folder's room with --disk-budget MiB")
        self.budget_bytes = budget_bytes

    def _open(self, record: Path) -> SparseCopy | None:
        try:
            rec = msgspec.msgpack.decode(record.read_bytes(), type=_Record)
            manifest = msgspec.msgpack.decode(rec.manifest, type=Manifest)
            if not IDENTITY.match(manifest.model) or record.stem != _stem(manifest.model):
                raise ValueError(f"it names model {manifest.model[:80]}")
            held = {i: t for i, t in rec.held.items() if 0 <= i < len(manifest.offsets)}
            return SparseCopy(self.folder, manifest, rec.file_name, held, rec.forms)
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ignoring %s in the model folder: %s", record.name, e)
            return None

    @property
    def held_bytes(self) -> int:
        return sum(c.held_bytes for c in self.copies.values())

    def disk_bytes(self) -> int:
        """What the copies take on disk: their pieces, and the token embedding's rows the head sent."""
        return sum(c.disk_bytes() for c in self.copies.values())

    def copy(self, manifest: Manifest, file_name: str) -> SparseCopy:
        """The copy of the manifest's model, made (empty) if the folder has none. A copy kept under another
        manifest of the same identity (pieces hashed otherwise) starts again empty."""
        old = self.copies.get(manifest.model)
        if old is not None and old.manifest == manifest:
            return old
        if old is not None:
            old.drop(list(old.held))
            old.close()
        copy = self.copies[manifest.model] = SparseCopy(self.folder, manifest, file_name)
        copy.save()
        return copy

    def make_room(self, copy: SparseCopy, need: Iterable[int], keep: dict[str, set[int]]) -> None:
        """Drop pieces, least recently used first, until `need` (pieces of `copy` to fetch) fits in the budget; never
        the pieces of `keep` (identity -> pieces in use or about to be) nor any copy's header."""
        missing = copy.missing(need)
        want = copy.bytes_of(missing)
        over = self.held_bytes + want - self.budget_bytes
        if over <= 0:
            return
        kept = {ident: set(k) for ident, k in keep.items()}
        kept.setdefault(copy.identity, set()).update(need)
        candidates = sorted((t, c.identity, i) for c in self.copies.values() for i, t in c.held.items()
                            if i not in kept.get(c.identity, ()) and c.manifest.offsets[i] >= c.manifest.header_bytes)
        dropped: dict[str, list[int]] = {}
        for _, ident, i in candidates:
            if over <= 0:
                break
            dropped.setdefault(ident, []).append(i)
            over -= self.copies[ident].manifest.lengths[i]
        if over > 0:
            raise DiskBudgetError(
                f"{copy.file_name}: this node's windows need {want / 2**20:.0f} MiB more on its disk, and its model "
                f"folder's budget of {self.budget_bytes / 2**20:.0f} MiB holds {self.held_bytes / 2**20:.0f} MiB it "
                "cannot drop: raise --disk-budget, or give this node fewer layers")
        for ident, indices in dropped.items():
            c = self.copies[ident]
            log.info("dropping %.1f MiB of %s from the model folder (least recently used) to make room",
                     c.bytes_of(indices) / 2**20, c.file_name)
            c.drop(indices)

    def close(self) -> None:
        for c in self.copies.values():
            c.close()
        self._lock.close()


@functools.cache
def _fallocate() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    f = getattr(ctypes.CDLL(name, use_errno=True), "fallocate", None) if name else None
    if f is not None:
        f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return f


def _punch(fd: int, offset: int, length: int) -> None:
    """Hand a range's bytes back to the file system, leaving a hole; where that cannot be done, overwrite it with
    zeros (what a hole reads as), so the copy never keeps bytes its record no longer vouches for."""
    f = _fallocate()
    if f is not None and f(fd, _PUNCH_HOLE, offset, length) == 0:
        return
    zeros = bytes(min(length, 2**20))
    for o in range(offset, offset + length, len(zeros)):
        os.pwrite(fd, zeros[:min(len(zeros), offset + length - o)], o)
