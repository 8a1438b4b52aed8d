"""The token embedding's rows a fetching first node lacks, sent with the token ids (wire/ring.py).

A node that fetched its layers (store/) holds no token embedding: a token reads one row of it, and the head holds
the file. Fetching it whole would cost the first node most of a small model's file (Gemma 3 270M: 163 of 241 MiB,
for a vocabulary of 262k rows), and fetching the 4 MiB pieces a prompt's tokens fall in, most of it again. So the
head sends each row, as the file stores it, with the messages that use its token until one of them comes back round
the ring (delivered); the node writes it into its copy, where llama.cpp looks the token up as in the whole file, so
the tokens are plain's. Against the head embedding tokens itself (n_embd float32 a token, every time, after each
architecture's own input scaling), a row is 3.8x (Q8_0) to 7.1x (Q4_K) smaller and crosses once
(docs/distribute.md).
"""

from __future__ import annotations

import os

import msgspec
import numpy as np

from primaplug.engine.layout import ModelLayout
from primaplug.wire import Activation


class EmbeddingRows:
    """Rows of one model's token embedding for the node running layer 0 of one ring (one assignment)."""

    def __init__(self, fd: int, layout: ModelLayout) -> None:
        t = layout.tensor("token_embd.weight")
        if t is None:
            raise ValueError(f"{layout.arch} has no token_embd.weight")
        self.fd, self.offset, self.n_vocab = fd, t.offset, t.shape[1]
        self.row_bytes = t.nbytes // self.n_vocab
        self.delivered: set[int] = set()
        self.sent_bytes = 0
        self._pending: dict[int, tuple[int, ...]] = {}  # step -> rows it carries

    def attach(self, msg: Activation, ids: np.ndarray) -> tuple[Activation, bytes]:
        """The message with the rows of its tokens that are not known to have arrived, and those rows."""
        new = tuple(sorted({int(i) for i in ids if 0 <= i < self.n_vocab} - self.delivered))
        if not new:
            return msg, b""
        data = b"".join(os.pread(self.fd, self.row_bytes, self.offset + i * self.row_bytes) for i in new)
        self._pending[msg.step] = new
        self.sent_bytes += len(data)
        return msgspec.structs.replace(msg, embd_rows=new), data

    def returned(self, step: int, ok: bool) -> None:
        """A step came back round the ring: the first node wrote its rows, unless it refused the step."""
        rows = self._pending.pop(step, ())
        if ok:
            self.delivered.update(rows)
