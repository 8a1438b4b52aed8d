"""Answering GetManifest and ReadPiece: the head for its model's file (HolderService, a socket and thread of its
own), a node for the pieces its copies hold (its control loop calls answer()).

A holder serves only models it was given, named by identity, never a path, and only to peers of the cluster: its
socket is the transport's, which admits only holders of the cluster key when keys are used.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

from primaplug.core.errors import ProtocolError
from primaplug.transport import Transport
from primaplug.wire import ErrorReply, GetManifest, Manifest, PieceData, ReadPiece, decode_request, encode

log = logging.getLogger(__name__)


class PieceSource(Protocol):
    manifest: Manifest

    def holds(self, index: int) -> bool: ...

    def read(self, index: int) -> bytes: ...


class WholeFile:
    """A whole model file, read through the descriptor opened once (a later rename or link changes nothing)."""

    def __init__(self, path: str | os.PathLike[str], manifest: Manifest) -> None:
        self.manifest = manifest
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(self.fd).st_size != manifest.file_size:
            os.close(self.fd)
            raise ProtocolError(f"{path} is not the file its manifest was made from (its size changed)")

    def holds(self, index: int) -> bool:
        return True

    def read(self, index: int) -> bytes:
        return os.pread(self.fd, self.manifest.lengths[index], self.manifest.offsets[index])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def answer(req: GetManifest | ReadPiece, holder: str, sources: Callable[[str], PieceSource | None]
           ) -> Manifest | PieceData | ErrorReply:
    """The reply to a piece request from what `sources` (model identity -> what holds it) gives."""
    source = sources(req.model)
    if source is None:
        return ErrorReply(node=holder, code="wrong_model", message=f"{holder} holds no copy of model {req.model[:80]}")
    if isinstance(req, GetManifest):
        return source.manifest
    n = len(source.manifest.offsets)
    if not 0 <= req.index < n:
        return ErrorReply(node=holder, code="bad_request", message=f"piece {req.index} does not exist (the model has "
                          f"{n})")
    if not source.holds(req.index):
        return ErrorReply(node=holder, code="missing", message=f"{holder} does not hold piece {req.index}")
    return PieceData(model=req.model, index=req.index, data=source.read(req.index))


class HolderService:
    """Serves one whole model file's pieces on a socket of its own (port 0: a free one), from a thread."""

    def __init__(self, transport: Transport, host: str, path: str | os.PathLike[str], manifest: Manifest) -> None:
        self.file = WholeFile(path, manifest)
        try:
            self.server = transport.control_server(host, 0)
        except BaseException:
            self.file.close()
            raise
        self.address = self.server.address
        self.served_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="holder", daemon=True)
        self._thread.start()

    def _sources(self, model: str) -> PieceSource | None:
        return self.file if model == self.file.manifest.model else None

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                got = self.server.recv(0.2)
                if got is None:
                    continue
                envelope, body = got
                try:
                    req = decode_request(body)
                except ProtocolError as e:
                    reply: Manifest | PieceData | ErrorReply = ErrorReply(node="head", code="bad_message",
                                                                          message=str(e)[:600])
                else:
                    if isinstance(req, GetManifest | ReadPiece):
                        try:
                            reply = answer(req, "head", self._sources)
                        except OSError as e:  # the file could not be read: the node asks the next holder
                            log.warning("the model holder could not read a piece: %s", e)
                            reply = ErrorReply(node="head", code="internal", message=f"could not read it: {e}")
                    else:
                        reply = ErrorReply(node="head", code="bad_message", message=f"this is the head's holder of "
                                           f"model pieces, which answers no {type(req).__name__}")
                if isinstance(reply, PieceData):
                    self.served_bytes += len(reply.data)
                self.server.reply(envelope, encode(reply))
        except Exception:  # a thread boundary: the nodes see it as a holder that stopped answering
            log.exception("the model holder stopped")
        finally:
            self.server.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.file.close()
