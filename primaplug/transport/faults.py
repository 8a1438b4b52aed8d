"""Fault injection: a Transport that wraps another and drops, delays or corrupts messages, or kills a peer, as
the test in charge tells it, so that ring logic can be tested against the failures of a real network.

    net = InprocNetwork()
    faults = FaultyTransport(InprocTransport(net))
    faults.drop_ring(after=2)              # the 3rd ring message sent through `faults` is lost
    faults.delay_control(0.5, reply=True)  # the next control reply leaves half a second late
    faults.kill(node_control, node_ring)   # that peer is gone: no answers, nothing delivered
    ...
    assert faults.log == [...]             # what was injected, to show that the fault really fired

Faults act where a message leaves (ring sends, control requests and replies), in the sending thread, with no
thread of their own: so they keep messages in order, as TCP does, and work over any inner transport. A delay
therefore holds its sender: the message leaves late, and whatever that socket sends next waits behind it.

Rules are tried in the order they were set; the first that matches a message fires (once per message). A
rule's `match` gets the frames (ring) or the body (control); `address` narrows it to one endpoint (the
destination of ring messages and requests, the server that sends a reply); `after` lets that many matching
messages through first; `count` is how many it then hits (None: every one from then on).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from primaplug.transport.base import ControlClient, ControlServer, Frames, RingIn, RingOut, Transport

_Bound = TypeVar("_Bound", "_FaultyControlServer", "_FaultyRingIn")


def truncate_last(frames: Frames) -> Frames:
    """The message with its last frame one byte short (an empty one gets a stray byte): a size check fails."""
    if not frames:
        return [b"\x00"]
    last = bytes(frames[-1])
    return [*frames[:-1], last[:-1] if last else b"\x00"]


def flip_last(frames: Frames) -> Frames:
    """The message with every byte of its last frame inverted: same sizes, wrong contents."""
    if not frames:
        return [b"\x00"]
    return [*frames[:-1], bytes(b ^ 0xFF for b in bytes(frames[-1]))]


@dataclass
class _Rule:
    what: str  # "ring", "request" or "reply"
    action: str  # "drop", "delay" or "corrupt"
    match: Callable[[Any], bool] | None
    address: str | None
    count: int | None
    after: int
    seconds: float = 0.0
    how: Callable[[Frames], Frames] = truncate_last

    def fires(self, what: str, address: str, payload: Any) -> bool:
        if self.what != what or self.count == 0 or self.address not in (None, address):
            return False
        if self.match is not None and not self.match(payload):
            return False
        if self.after > 0:
            self.after -= 1
            return False
        if self.count is not None:
            self.count -= 1
        return True


class FaultyTransport:
    """Any Transport, with faults injected into the sockets made through it (see the module docstring)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.keys = inner.keys
        self.log: list[str] = []  # one line per fault that fired, in order
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._killed: set[str] = set()
        self._bound: dict[str, _FaultyControlServer | _FaultyRingIn] = {}

    # --- the faults ---------------------------------------------------------------------------------------

    def drop_ring(self, match: Callable[[Frames], bool] | None = None, count: int | None = 1, *,
                  address: str | None = None, after: int = 0) -> None:
        """Lose ring messages on the way: send() still returns True, as the sender of a lost packet sees it."""
        self._add(_Rule("ring", "drop", match, address, count, after))

    def delay_ring(self, seconds: float, match: Callable[[Frames], bool] | None = None, count: int | None = 1, *,
                   address: str | None = None, after: int = 0) -> None:
        """Send ring messages `seconds` late."""
        self._add(_Rule("ring", "delay", match, address, count, after, seconds=seconds))

    def corrupt_ring(self, match: Callable[[Frames], bool] | None = None, count: int | None = 1,
                     how: Callable[[Frames], Frames] = truncate_last, *, address: str | None = None,
                     after: int = 0) -> None:
        """Deliver ring messages changed by `how` (default: the last frame one byte short; see flip_last)."""
        self._add(_Rule("ring", "corrupt", match, address, count, after, how=how))

    def drop_control(self, match: Callable[[bytes], bool] | None = None, count: int | None = 1, *,
                     reply: bool = False, address: str | None = None, after: int = 0) -> None:
        """Lose control requests (or, with reply=True, replies): the client's take_reply() times out."""
        self._add(_Rule("reply" if reply else "request", "drop", match, address, count, after))

    def delay_control(self, seconds: float, match: Callable[[bytes], bool] | None = None, count: int | None = 1,
                      *, reply: bool = False, address: str | None = None, after: int = 0) -> None:
        """Send control requests (or, with reply=True, replies) `seconds` late."""
        self._add(_Rule("reply" if reply else "request", "delay", match, address, count, after, seconds=seconds))

    def kill(self, *addresses: str) -> None:
        """The peers bound at these endpoints die now: their control servers and ring inputs made through this
        transport are closed (what they held unread is lost) and answer nothing from now on, and sockets made
        through this transport can no longer reach them. The inner sockets are closed from the calling
        thread, which InprocTransport allows; ZeroMQ sockets must not be closed under a thread using them."""
        with self._lock:
            self._killed.update(addresses)
            dying = [self._bound[a] for a in addresses if a in self._bound]
            self.log.extend(f"kill {a}" for a in addresses)
        for sock in dying:
            sock.die()

    def killed(self, address: str) -> bool:
        with self._lock:
            return address in self._killed

    def clear(self) -> None:
        """Forget the rules that have not fired yet (the dead stay dead)."""
        with self._lock:
            self._rules.clear()

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _fire(self, what: str, address: str, payload: Any) -> _Rule | None:
        with self._lock:
            rule = next((r for r in self._rules if r.fires(what, address, payload)), None)
            self._rules = [r for r in self._rules if r.count != 0]
            return rule

    def _note(self, line: str) -> None:
        with self._lock:
            self.log.append(line)

    # --- the Transport ------------------------------------------------------------------------------------

    def control_server(self, host: str, port: int) -> ControlServer:
        return self._register(_FaultyControlServer(self.inner.control_server(host, port), self))

    def control_client(self, address: str) -> ControlClient:
        return _FaultyControlClient(self.inner.control_client(address), self)

    def ring_in(self, host: str, port: int) -> RingIn:
        return self._register(_FaultyRingIn(self.inner.ring_in(host, port), self))

    def ring_out(self, address: str) -> RingOut:
        return _FaultyRingOut(self.inner.ring_out(address), self)

    def close(self) -> None:
        self.inner.close()

    def _register(self, sock: _Bound) -> _Bound:
        with self._lock:
            self._bound[sock.address] = sock
        if self.killed(sock.address):  # a peer killed before it bound is dead on arrival
            sock.die()
        return sock


class _Killable:
    """A bound socket (a peer's control server or ring input) that FaultyTransport.kill() can make die."""

    def __init__(self, inner: ControlServer | RingIn, faults: FaultyTransport) -> None:
        self.inner, self.faults, self.address = inner, faults, inner.address
        self.dead = False

    def die(self) -> None:
        if not self.dead:
            self.dead = True
            self.inner.close()

    def recv(self, timeout_s: float) -> Any:
        if self.dead:  # a dead process reads nothing; sleep as an idle poll would
            time.sleep(max(0.0, timeout_s))
            return None
        got = self.inner.recv(timeout_s)
        return None if self.dead else got

    def close(self) -> None:
        if not self.dead:
            self.inner.close()


class _FaultyControlServer(_Killable):
    inner: ControlServer

    def reply(self, envelope: list[bytes], body: bytes) -> None:
        if self.dead:
            return
        rule = self.faults._fire("reply", self.address, body)
        if rule is not None:
            self.faults._note(f"{rule.action} reply <- {self.address}"
                              + (f" ({rule.seconds:g} s)" if rule.action == "delay" else ""))
            if rule.action == "drop":
                return
            time.sleep(rule.seconds)
        self.inner.reply(envelope, body)


class _FaultyControlClient:
    def __init__(self, inner: ControlClient, faults: FaultyTransport) -> None:
        self.inner, self.faults, self.address = inner, faults, inner.address
        self._lost: set[int] = set()  # ids of requests that never left, so take_reply knows not to wait for them
        self._lost_ids = itertools.count(-1, -1)  # negative: the inner client's ids count up from 1

    def send(self, body: bytes) -> int:
        if self.faults.killed(self.address):
            self.faults._note(f"lost request -> {self.address} (killed)")
            return self._lose()
        rule = self.faults._fire("request", self.address, body)
        if rule is not None:
            self.faults._note(f"{rule.action} request -> {self.address}"
                              + (f" ({rule.seconds:g} s)" if rule.action == "delay" else ""))
            if rule.action == "drop":
                return self._lose()
            time.sleep(rule.seconds)
        return self.inner.send(body)

    def _lose(self) -> int:
        rid = next(self._lost_ids)
        self._lost.add(rid)
        return rid

    def take_reply(self, rid: int, timeout_s: float) -> bytes | None:
        if rid in self._lost:  # kept: a caller may poll for the same id again (with timeout 0)
            time.sleep(max(0.0, timeout_s))
            return None
        return self.inner.take_reply(rid, timeout_s)

    def request(self, body: bytes, timeout_s: float) -> bytes | None:
        return self.take_reply(self.send(body), timeout_s)

    def close(self) -> None:
        self.inner.close()


class _FaultyRingIn(_Killable):
    inner: RingIn


class _FaultyRingOut:
    def __init__(self, inner: RingOut, faults: FaultyTransport) -> None:
        self.inner, self.faults, self.address = inner, faults, inner.address

    def send(self, frames: Sequence[bytes | memoryview], timeout_s: float) -> bool:
        if self.faults.killed(self.address):  # nobody listens there any more: a send times out, as with zmq
            self.faults._note(f"refused ring -> {self.address} (killed)")
            time.sleep(max(0.0, timeout_s))
            return False
        rule = self.faults._fire("ring", self.address, list(frames))
        if rule is not None:
            self.faults._note(f"{rule.action} ring -> {self.address}"
                              + (f" ({rule.seconds:g} s)" if rule.action == "delay" else ""))
            if rule.action == "drop":
                return True  # lost on the way: the sender cannot tell
            if rule.action == "delay":
                time.sleep(rule.seconds)
            else:
                frames = rule.how(list(frames))  # new frames: the sender's buffers stay as they were
        return self.inner.send(frames, timeout_s)

    def close(self) -> None:
        self.inner.close()

