"""Which head a node belongs to: one at a time, so that two heads never deploy over each other.

A node belongs to the head whose load, unload or profile request it last accepted, for as long as that head keeps
speaking (any request naming it, or a ring message of its assignment) within the lease. While the holder lives, the
same requests from another head are refused with the holder named; `take_over` takes the node anyway, on purpose.
The holder lets the node go when it closes (Unload with release); a holder that dies lets it go when its lease
lapses. Status requests are answered for everyone, and say who holds the node.
"""

from __future__ import annotations

import logging
import time

from primaplug.core.settings import HEAD_LEASE_S
from primaplug.wire import HeadTag, Holder

log = logging.getLogger(__name__)


class Ownership:
    def __init__(self, lease_s: float = HEAD_LEASE_S) -> None:
        self.lease_s = lease_s
        self._head: HeadTag | None = None
        self._since = 0.0  # Unix time
        self._heard = 0.0  # time.monotonic()

    def holder(self) -> Holder | None:
        """The head this node belongs to now; None when free (nobody took it, it was let go, or the lease lapsed)."""
        head, silent = self._head, time.monotonic() - self._heard
        if head is None or silent >= self.lease_s:
            return None
        return Holder(head=head, since=self._since, silent_s=silent, lease_s=self.lease_s)

    def heard(self, head: HeadTag | None) -> None:
        """A request named `head`: if it is the holder, its lease starts again (and its figures are the latest)."""
        if head is not None and self._head is not None and head.id == self._head.id:
            self._head, self._heard = head, time.monotonic()

    def heard_holder(self) -> None:
        """A ring message of the holder's assignment came: only the holder sends those."""
        if self._head is not None:
            self._heard = time.monotonic()

    def refusal(self, head: HeadTag | None, what: str, take_over: bool) -> str:
        """Why `head` may not do `what` here ("" when it may): another head holds the node."""
        h = self.holder()
        if h is None or take_over or (head is not None and head.id == h.head.id):
            return ""
        return (f"this node belongs to {h.describe()}, so another head may not {what} here. Wait until that head "
                f"closes (or has been silent for {h.lease_s:g} s), or take the node over on purpose: --take-over "
                "(take_over=True in primaplug.Llama, T in the dashboard)")

    def claim(self, head: HeadTag | None, node: str) -> None:
        """`head` uses the node now (the caller checked refusal() first)."""
        if head is None:
            return
        h = self.holder()
        if h is None or h.head.id != head.id:
            if h is not None:
                log.warning("node %s taken over by %s from %s", node, _who(head), h.describe())
            elif self._head is not None and self._head.id != head.id:
                log.info("node %s now belongs to %s (%s lapsed or let it go)", node, _who(head), _who(self._head))
            else:
                log.info("node %s now belongs to %s", node, _who(head))
            self._since = time.time()
        self._head, self._heard = head, time.monotonic()

    def release(self, head: HeadTag | None, node: str) -> None:
        """The holder lets the node go (it closes)."""
        if head is not None and self._head is not None and head.id == self._head.id:
            log.info("node %s let go by %s", node, _who(head))
            self._head = None


def _who(head: HeadTag) -> str:
    return f"head {head.id[:8]} ({head.name})"
