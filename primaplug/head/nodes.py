"""One node as the head sees it: a control connection with request timeouts and typed errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from primaplug import __version__
from primaplug.core.errors import NodeError, NodeHeldError, NodeUnavailableError, ProtocolError
from primaplug.core.profiles import DeviceProfile
from primaplug.core.settings import HELD_WAIT_AFTER_S, LOAD_TIMEOUT_S, TIMEOUT_S
from primaplug.head.identity import Head
from primaplug.transport import ControlClient, Transport, endpoint, split_address
from primaplug.wire import (
    PROTOCOL_VERSION,
    Assignment,
    ControlReply,
    ControlRequest,
    ErrorReply,
    FileSource,
    GetProfile,
    GetStatus,
    Hello,
    Holder,
    LoadAssignment,
    ProfileReply,
    Shutdown,
    Status,
    Unload,
    Welcome,
    decode_reply,
    encode,
)

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 1.0  # a head that lets a node go waits this long for its answer (a lost one never answers)


class NodeClient:
    """The control channel to one node, named by its HOST:PORT address, for one head (`head`: every request names it;
    default: a head of its own)."""

    def __init__(self, transport: Transport, address: str, timeout_s: float = TIMEOUT_S, *,
                 head: Head | None = None) -> None:
        self.address = address
        self.head = head or Head()
        self.claimed = False  # whether the node accepted a load, unload or profile from this head (it holds it)
        self.closed = False
        self.timeout_s = timeout_s
        self.client: ControlClient = transport.control_client(endpoint(*split_address(address)))
        self.name = address  # replaced by the node's own name after hello()
        self.welcome: Welcome | None = None
        self.last_status: Status | None = None
        self.last_heard = 0.0  # time.monotonic() of the node's last reply, to a request or a probe
        self._probe: int | None = None
        # the ring's driver probes while request threads ask (ring_problem, metrics): one socket, one at a time
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return self.name if self.name == self.address else f"{self.name} ({self.address})"

    def _ask(self, req: ControlRequest, timeout_s: float | None = None) -> ControlReply:
        try:
            return self._ask_once(req, timeout_s)
        except NodeHeldError as e:
            h = e.holder
            if not isinstance(h, Holder) or h.silent_s < HELD_WAIT_AFTER_S:
                raise
            # its holder stopped speaking: it likely died (a killed head cannot let its nodes go); its lease ends soon
            wait = max(0.0, h.lease_s - h.silent_s) + 0.2
            log.warning("node %s belongs to %s; waiting %.1f s for that head's lease to lapse", self, h.describe(),
                        wait)
            time.sleep(wait)
            return self._ask_once(req, timeout_s)

    def _ask_once(self, req: ControlRequest, timeout_s: float | None = None) -> ControlReply:
        t = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            body = self.client.request(encode(req), t)
            self._probe = None  # its reply, if any came first, was dropped: this one counts instead
            if body is not None:
                self.last_heard = time.monotonic()
        if body is None:
            raise NodeUnavailableError(self.name, f"node {self} did not answer {type(req).__name__} within {t:.1f} s "
                                       "(is it running, and does it hold the same cluster key?)")
        reply = decode_reply(body)
        if isinstance(reply, ErrorReply):
            if reply.code == "held":
                raise NodeHeldError(str(self), reply.message, reply.holder)
            raise NodeError(str(self), reply.code, reply.message)
        if isinstance(req, LoadAssignment | Unload | GetProfile) and not getattr(req, "release", False):
            self.claimed = True
        return reply

    def hello(self) -> Welcome:
        reply = self._ask(Hello(proto=PROTOCOL_VERSION, software=__version__))
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"node {self} answered hello with {type(reply).__name__}")
        self.welcome, self.name = reply, reply.node
        return reply

    def _status_reply(self, req: ControlRequest, timeout_s: float | None = None) -> Status:
        reply = self._ask(req, timeout_s)
        if not isinstance(reply, Status):
            raise ProtocolError(f"node {self} answered {type(req).__name__} with {type(reply).__name__}")
        self.last_status = reply
        return reply

    def load(self, assignment: Assignment, source: FileSource | None = None) -> Status:
        """Send the node its windows; `source`: where it fetches the parts of the model it lacks."""
        return self._status_reply(LoadAssignment(assignment=assignment, head=self.head.tag(),
                                                 take_over=self.head.take_over, source=source))

    def status(self, detail: bool = False, timeout_s: float | None = None) -> Status:
        """The node's state; with detail, also its memory measurements (prefetch, faults, residency, pressure)."""
        return self._status_reply(GetStatus(detail=detail, head=self.head.tag()), timeout_s)

    def taken_by(self, status: Status) -> Holder | None:
        """The other head that holds the node, as the status says (None when it is free, or this head's)."""
        h = status.holder
        return h if h is not None and h.head.id != self.head.id else None

    def profile(self, model: str, *, force: bool = False, timeout_s: float = LOAD_TIMEOUT_S,
                progress: Callable[[str], None] | None = None, source: FileSource | None = None) -> DeviceProfile:
        """The node's DeviceProfile for the model of that identity, waiting while the node measures itself (and
        fetches the model's header first, from `source`, where it lacks the file)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._ask(GetProfile(model=model, force=force, head=self.head.tag(), take_over=self.head.take_over,
                                         source=source))
            if not isinstance(reply, ProfileReply):
                raise ProtocolError(f"node {self} answered GetProfile with {type(reply).__name__}")
            if reply.profile is not None:
                return reply.profile
            force = False  # the measurement has started; asking again with force would restart it
            if progress:
                progress(reply.message)
            if time.monotonic() > deadline:
                raise NodeUnavailableError(self.name, f"node {self} did not finish profiling within {timeout_s:.0f} s")
            time.sleep(0.2)

    def unload(self) -> Status:
        return self._status_reply(Unload(head=self.head.tag(), take_over=self.head.take_over))

    def release(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        """Free the node's windows and let it go, so that another head may deploy there at once: a head that
        closes. Nothing to do for a node this head never used."""
        if self.claimed and not self.closed:  # a client closed already (a lost node's) has nothing to say
            self._status_reply(Unload(head=self.head.tag(), release=True), timeout_s)
            self.claimed = False

    def shutdown(self) -> Status:
        return self._status_reply(Shutdown(head=self.head.tag(), take_over=self.head.take_over))

    # --- probing while the ring computes: a status request that does not block ---------------------------

    def probe(self) -> None:
        """Ask for a status without waiting; poll_probe() collects it."""
        with self._lock:
            if self._probe is None:
                self._probe = self.client.send(encode(GetStatus(head=self.head.tag())))

    def poll_probe(self) -> Status | None:
        with self._lock:
            if self._probe is None:
                return None
            body = self.client.take_reply(self._probe, 0)
            if body is None:
                return None
            self._probe = None
            self.last_heard = time.monotonic()
        reply = decode_reply(body)
        if isinstance(reply, Status):
            self.last_status = reply
            return reply
        return None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.client.close()
