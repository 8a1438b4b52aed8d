"""Fetching pieces of a model file from its holders into a sparse copy.

Requests are pipelined (DEPTH pieces in flight to one holder: its replies come in order), every piece is checked
against the manifest before it is written, and the manifest against the digest the head gave. A holder that does
not answer, answers with something else, or sends pieces that do not match their hash (STRIKES of them) is dropped
with the reason, and the next one is asked; a holder whose copy lacks a piece says so, and the next one is asked
for that piece. What was written is recorded every SAVE_EVERY_S, so a fetch cut off resumes where it stopped.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from primaplug.core.errors import PrimaplugError, ProtocolError
from primaplug.core.settings import TIMEOUT_S
from primaplug.store.copy import SparseCopy
from primaplug.transport import ControlClient, Transport
from primaplug.wire import ErrorReply, FileSource, GetManifest, Manifest, PieceData, ReadPiece, decode_reply, encode

log = logging.getLogger(__name__)

DEPTH = 4  # pieces in flight to one holder: enough to keep a link busy through each request's round trip
STRIKES = 3  # pieces that fail their hash before a holder is dropped (one may be a flipped bit on the way)
SAVE_EVERY_S = 1.0


class FetchError(PrimaplugError):
    """No holder could give what a node needs; the message says what each one did."""


@dataclass(frozen=True)
class FetchProgress:
    done_bytes: int
    total_bytes: int
    rate_bps: float  # since the fetch began
    holder: str

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0

    def describe(self, what: str) -> str:
        mib = 2**20
        left = (self.total_bytes - self.done_bytes) / self.rate_bps if self.rate_bps > 0 else float("nan")
        eta = f", {left:.0f} s left" if left == left else ""
        return (f"fetching {what}: {self.done_bytes / mib:.0f} of {self.total_bytes / mib:.0f} MiB from "
                f"{self.holder} at {self.rate_bps / 1e6:.1f} MB/s{eta}")


class Fetcher:
    """Fetches one model's pieces from the holders of a FileSource, in their order, dropping those that fail."""

    def __init__(self, transport: Transport, source: FileSource, model: str, *, timeout_s: float = TIMEOUT_S,
                 stop: Callable[[], bool] = lambda: False) -> None:
        self.transport, self.source, self.model = transport, source, model
        self.timeout_s, self.stop = timeout_s, stop
        self.dropped: dict[str, str] = {}  # holder -> why it was dropped
        self.lacking: dict[str, int] = {}  # holder -> pieces it said it lacks, in the last fetch
        self.bytes_received = 0  # every piece's bytes as they came, those that failed their hash included

    def _alive(self) -> list[str]:
        return [h for h in self.source.holders if h not in self.dropped]

    def _drop(self, holder: str, why: str) -> None:
        log.warning("dropped holder %s: %s", holder, why)
        self.dropped[holder] = why

    def _failed(self, what: str) -> FetchError:
        why = "; ".join([f"{h}: {w}" for h, w in self.dropped.items()]
                        + [f"{h} lacks {n} of them" for h, n in self.lacking.items() if h not in self.dropped])
        why = why or "no holder was given"
        return FetchError(f"could not fetch {what} of model {self.model} ({why}): check that the head still runs "
                          "and holds the model's file")

    def manifest(self) -> Manifest:
        """The model's manifest from the first holder that gives the one the head's digest names."""
        for holder in self._alive():
            client = self.transport.control_client(holder)
            try:
                body = client.request(encode(GetManifest(model=self.model)), self.timeout_s)
            finally:
                client.close()
            if body is None:
                self._drop(holder, f"did not answer within {self.timeout_s:.1f} s")
                continue
            try:
                reply = decode_reply(body)
            except ProtocolError as e:
                self._drop(holder, str(e))
                continue
            if isinstance(reply, ErrorReply):
                self._drop(holder, f"{reply.code}: {reply.message}")
            elif not isinstance(reply, Manifest) or reply.model != self.model:
                self._drop(holder, f"answered a manifest request with {type(reply).__name__}")
            elif reply.digest() != self.source.manifest_sha256:
                self._drop(holder, "sent a manifest other than the head's (its digest differs)")
            else:
                return reply
        raise self._failed("the manifest")

    def fetch(self, copy: SparseCopy, indices: Iterable[int], *, what: str = "",
              progress: Callable[[FetchProgress], None] | None = None) -> int:
        """Fetch the pieces of `indices` that the copy lacks, verify and write them; returns the bytes written."""
        todo = copy.missing(indices)
        total, done, t0 = copy.bytes_of(todo), 0, time.perf_counter()
        saved = time.monotonic()
        holder = ""
        self.lacking = {}

        def report() -> None:
            if progress is not None:
                dt = time.perf_counter() - t0
                progress(FetchProgress(done, total, done / dt if dt > 0 else 0.0, holder))

        def stored(i: int, data: bytes) -> None:
            nonlocal done, saved
            copy.write(i, data)
            done += len(data)
            if time.monotonic() - saved > SAVE_EVERY_S:
                copy.save()
                saved = time.monotonic()
            report()

        try:
            for holder in self._alive():
                if not todo:
                    break
                report()
                lacking = self._from(holder, copy, todo, stored, what)
                todo = [i for i in todo if i not in copy.held]
                if lacking and holder not in self.dropped:
                    self.lacking[holder] = len(lacking)
                    log.info("holder %s lacks %d piece(s); asking the next", holder, len(lacking))
        finally:
            copy.save()
        if todo:
            raise self._failed(f"{len(todo)} piece(s) ({copy.bytes_of(todo) / 2**20:.1f} MiB)")
        report()
        return done

    def _from(self, holder: str, copy: SparseCopy, todo: list[int], stored: Callable[[int, bytes], None],
              what: str) -> list[int]:
        """Ask one holder for the pieces of `todo`, DEPTH at a time, handing each good one to `stored`; returns those
        it lacks. A holder that fails or lies is dropped (self.dropped says why) and the rest is left for the next."""
        lacking: list[int] = []
        queue = collections.deque(todo)
        inflight: collections.deque[tuple[int, int]] = collections.deque()
        strikes = 0
        client = self.transport.control_client(holder)
        try:
            while queue or inflight:
                if self.stop():
                    raise FetchError(f"stopped while fetching {what or self.model}")
                while queue and len(inflight) < DEPTH:
                    i = queue.popleft()
                    inflight.append((client.send(encode(ReadPiece(model=self.model, index=i))), i))
                rid, i = inflight.popleft()
                why, data = self._piece(client, rid, i, copy)
                if why == "missing":
                    lacking.append(i)
                elif why == "hash":
                    strikes += 1
                    if strikes >= STRIKES:
                        self._drop(holder, f"sent {strikes} pieces that do not match their hash")
                        break
                    log.warning("piece %d from %s does not match its hash: fetching it again", i, holder)
                    queue.appendleft(i)
                elif why:
                    self._drop(holder, why)
                    break
                else:
                    assert data is not None
                    stored(i, data)
        finally:
            client.close()
        return lacking

    def _piece(self, client: ControlClient, rid: int, index: int, copy: SparseCopy) -> tuple[str, bytes | None]:
        """("", bytes) for a good piece; else ("missing", None), ("hash", None) or (why the holder is dropped, None)."""
        body = client.take_reply(rid, self.timeout_s)
        if body is None:
            return f"did not send piece {index} within {self.timeout_s:.1f} s", None
        self.bytes_received += len(body)
        try:
            reply = decode_reply(body)
        except ProtocolError as e:
            return str(e), None
        if isinstance(reply, ErrorReply):
            return ("missing", None) if reply.code == "missing" else (f"{reply.code}: {reply.message}", None)
        m = copy.manifest
        if not isinstance(reply, PieceData) or reply.model != self.model or reply.index != index:
            return f"answered a request for piece {index} with {type(reply).__name__}", None
        if len(reply.data) != m.lengths[index] or hashlib.sha256(reply.data).digest() != m.piece_sha256(index):
            return "hash", None
        return "", reply.data
