"""Keeping the ring going when nodes are lost, restart or join.

A request whose batch fails because a node went silent or lost its windows (head/session.py) asks Recovery for a
ring to go on with. Recovery re-forms it, once for every request in flight:

1. survey: ask every node of the ring for its status (a short timeout): the silent ones are lost; those another head
   holds now (it took them over on purpose, --take-over) are taken: they are left alone, never loaded over, until
   that head lets them go; those that answer free and without the assignment (restarted, or freed their windows) are
   loaded again;
2. re-plan the nodes there are, with nodes that appeared meanwhile (a lost one back, one discovered): with the
   scheduler and the profiles measured at the start when the ring was planned, else the split by hand rescaled to
   them; the head keeps its windows (every request's context reads its model);
3. deploy under a new assignment id, and open a new ring driver (head/batching.py);
4. each session replays its prefix onto it and carries on (head/session.py): greedy text is the text of an
   uninterrupted run.

When no request runs, a heartbeat thread asks every node for its status every HEARTBEAT_S (which also tells nodes
their head is there): a node that restarted, went silent or came back is re-planned at once, so the next request
finds a working ring. Each re-forming is published (events.Reformed), with where its time went. When the nodes
left cannot run the model (every node taken, say), the ring waits broken (`problem()` says why, and requests fail
with it) and the heartbeat re-forms it as soon as the nodes are free again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import numpy as np

from primaplug.core.errors import NodeError, NodeUnavailableError, PrimaplugError, ProtocolError
from primaplug.core.settings import HEAD_LEASE_S, HEARTBEAT_S
from primaplug.head.batching import Batcher
from primaplug.head.cluster import Cluster, unique_names
from primaplug.head.events import NodeProgress, Notice, Reformed
from primaplug.head.nodes import NodeClient
from primaplug.head.planning import Measured, PlanSettings
from primaplug.scheduler import solve
from primaplug.scheduler.halda import apportion
from primaplug.transport import is_loopback, split_address
from primaplug.wire import Holder

log = logging.getLogger(__name__)

SURVEY_S = 1.0  # a node's control loop answers at once, even while it computes or loads: silence is an answer
RETRY_S = 5.0  # after a re-forming failed, the heartbeat waits this long before it tries again
# a re-forming the heartbeat found needed waits for a moment when no request runs, but no longer than this: under
# steady load that moment may never come (the requests in flight then replay onto the new ring)
BOUNDARY_WAIT_S = 5.0


@dataclass(frozen=True)
class Split:
    """A re-formed ring's nodes (in ring order) and, for each, its layers per round, its GPU layers and its room
    (Assignment.stream_room; 0: its own rule); `how` says how they were chosen."""

    nodes: list[NodeClient]
    sizes: list[int]
    gpu: list[int]
    rooms: list[int]
    how: str


@dataclass
class Replanner:
    """How a re-formed ring's windows are chosen: the scheduler again over the devices' profiles when the first ring
    was planned from measurements, else each node's share of the first split by hand (by address), rescaled."""

    measured: Measured | None = None
    settings: PlanSettings | None = None
    by_hand: dict[str, int] = field(default_factory=dict)  # node address -> its layers per round in the first ring
    gpu: dict[str, int] = field(default_factory=dict)  # node address -> GPU layers of its windows (by hand)
    no_gpu: set[str] = field(default_factory=set)  # joiners that refused or failed to load the GPU layers given
    _given: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # str(node) -> a joiner given -ngl

    @classmethod
    def of(cls, cluster: Cluster, measured: Measured | None, settings: PlanSettings | None) -> Replanner:
        return cls(measured, settings, dict(zip([n.address for n in cluster.nodes], cluster.node_sizes(), strict=True)),
                   dict(zip([n.address for n in cluster.nodes], cluster.node_gpu, strict=True)))

    def split(self, cluster: Cluster, nodes: Sequence[NodeClient]) -> Split:
        """The nodes that get windows, and what each gets; rooms only where the scheduler chose the windows."""
        total = cluster.model.n_layer // cluster.rounds - cluster.head_size
        if not nodes or total < 1:
            raise PrimaplugError(
                "no node is left to run the layers the head does not hold "
                f"({cluster.model.n_layer - cluster.head_size * cluster.rounds} of {cluster.model.n_layer}): start a "
                "node (it joins at the next request), or restart with the head alone")
        if self.measured is not None and self.settings is not None:
            return self._scheduled(cluster, list(nodes), total)
        mean = float(np.mean(list(self.by_hand.values()))) if self.by_hand else 1.0
        weights = [self.by_hand.get(n.address, mean) for n in nodes]
        nodes = list(nodes)[:total]  # more nodes than layers: the last ones wait outside
        sizes = [int(x) for x in apportion(weights[: len(nodes)], total)]
        joiner = 0 if len(set(self.gpu.values())) != 1 else next(iter(self.gpu.values()))
        gpu = []
        self._given.clear()
        for n, s in zip(nodes, sizes, strict=True):
            if n.address in self.gpu:
                gpu.append(min(self.gpu[n.address], s))
            else:  # -ngl N was for every node, and so for one that joins; different counts name none for it
                gpu.append(0 if n.address in self.no_gpu else min(joiner, s))
                if gpu[-1]:
                    self._given[str(n)] = n.address
        return Split(nodes, sizes, gpu, [0] * len(nodes),
                     f"the split by hand rescaled to {len(nodes)} node(s): {sizes} layers per round")

    def refused(self, error: PrimaplugError) -> bool:
        """Whether `error` is a node that joined refusing, or failing to load, the GPU layers split() gave it (an
        engine without a GPU backend refuses them): from the next split on it gets none, so that a node without a
        GPU joining a ring given -ngl does not keep the ring from re-forming."""
        address = self._given.get(error.node) if isinstance(error, NodeError) and error.code in (
            "bad_assignment", "load_failed") else None
        if address is None:
            return False
        self.no_gpu.add(address)
        return True

    def _scheduled(self, cluster: Cluster, nodes: list[NodeClient], total: int) -> Split:
        m, s = self.measured, self.settings
        assert m is not None and s is not None
        known = {p.name: p for p in m.devices[1:]}
        devices = [m.devices[0]]
        for n in nodes:
            p = known.get(n.name)
            if p is None:  # joined since: its profile (cached on the node) with the links measured at the start
                p = msgspec.structs.replace(n.profile(cluster.model.identity, source=cluster.source(n)), name=n.name,
                                            link_latency_s=m.link_latency_s, link_bps=m.link_bps)
            devices.append(p)
        plan = solve(devices, m.model, scheduler=s.scheduler, rounds=cluster.rounds, slow_disk_bps=s.slow_disk_bps,
                     latency_model=s.latency_model)
        kept = [n for n in nodes if any(d.name == n.name for d in plan.devices)]
        if not kept:
            raise PrimaplugError(f"the {s.scheduler} scheduler puts every layer on the head now, which holds only its "
                                 "own windows: restart the head to run alone, or start a node")
        w = [plan.device(n.name).w for n in kept]
        sizes = [int(x) for x in apportion(w, total)] if sum(w) != total else w
        gpu = [min(plan.device(n.name).n, x) for n, x in zip(kept, sizes, strict=True)]
        how = f"{s.scheduler} over the {len(kept)} node(s) there are"
        rooms = [0] * len(kept)
        if sizes != w:  # rooms were chosen for the plan's windows, not these: each node's own rule
            how += (f" (it gives the head {plan.head.w} layers a round, which keeps its {cluster.head_size}: the "
                    f"nodes' {w} rescaled to {sizes})")
        elif plan.rooms_sent is not None:
            rooms = [plan.device(n.name).room for n in kept]
            how += f"; {plan.describe_rooms()}"
        return Split(kept, sizes, gpu, rooms, how)


class Driver(Protocol):
    """What the head's requests call on the ring's driver (head/batching.py: Batcher): a session's forward and
    kv_remove (head/session.py: Ring), a request's end (idle), and the heartbeat's look (busy)."""

    epoch: int

    @property
    def busy(self) -> bool: ...

    def forward(self, tokens: Sequence[int], pos0: int, *, seq_id: int = 0, all_rows: bool = False,
                hidden: bool = False) -> np.ndarray: ...

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None: ...

    def idle(self, seq_id: int) -> None: ...

    def close(self) -> None: ...


class _Broken:
    """The ring after a re-forming that failed, or while another head holds its nodes: a Driver whose every step
    fails with why (code "reform_failed", or "taken"), until the next re-forming replaces it."""

    busy = False  # nothing in flight: the heartbeat may survey the nodes

    def __init__(self, epoch: int, why: str, code: str = "reform_failed") -> None:
        self.epoch, self.why, self.code = epoch, why, code

    def forward(self, tokens: Sequence[int], pos0: int, *, seq_id: int = 0, all_rows: bool = False,
                hidden: bool = False) -> np.ndarray:
        raise NodeError("ring", self.code, self.why)

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        raise NodeError("ring", self.code, self.why)

    def idle(self, seq_id: int) -> None:
        pass

    def close(self) -> None:
        pass


class Recovery:
    """Re-forms the ring of a primaplug.Llama (the Reform of its sessions, head/session.py), and runs its heartbeat.

    `open_ring(cluster)` makes the ring driver for the cluster as deployed; `idle()` says that no request runs (a
    request boundary); `candidates()` gives addresses of nodes that may join (discovery), besides lost ones."""

    def __init__(self, cluster: Cluster, first: Batcher, open_ring: Callable[[Cluster], Batcher], replanner: Replanner,
                 *, idle: Callable[[], bool], candidates: Callable[[], Sequence[str]] | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.cluster, self.open_ring, self.replanner = cluster, open_ring, replanner
        self.ring: Driver = first
        self.idle, self.candidates = idle, candidates
        self.events = cluster.events
        self.pending: str | None = None  # why the ring should be re-formed at the next request boundary
        self.failure: str | None = None  # why the last re-forming failed (None: it did not, or none was needed)
        self.reports: list[Reformed] = []
        self._departed: dict[str, NodeClient] = {}  # address -> a client to a node lost or left, to see it return
        self._taken: dict[str, str] = {}  # node name -> the id of the head that took it, as last reported
        self._lock = threading.RLock()
        self._retry_at = 0.0  # time.monotonic() before which the heartbeat does not try again after a failure
        self._pending_since = 0.0  # time.monotonic() when `pending` was first set
        self._settling_since = 0.0  # time.monotonic() when nodes taken from this head were first seen coming back
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="primaplug-heartbeat",
                                        daemon=True) if cluster.nodes else None
        if self._thread is not None:
            self._thread.start()

    # --- what sessions call --------------------------------------------------------------------------------------

    def current(self) -> Driver:
        return self.ring

    def __call__(self, failed: object, error: BaseException) -> Driver:
        with self._lock:
            if self.ring is not failed:  # another request re-formed it meanwhile
                return self.current()
            return self._reform(f"{error}", error)

    def at_boundary(self) -> None:
        """A request starts and none runs: re-form now if the heartbeat found it needed."""
        if self.pending is not None:
            with self._lock:
                if self.pending is not None and self.idle():
                    self._try(self.pending)

    def problem(self) -> str | None:
        """What keeps the ring from serving, as far as the heartbeat knows: None while it works or can be re-formed."""
        return self.failure

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self.ring.close()
            for n in self._departed.values():
                n.close()
            self._departed.clear()

    # --- re-forming --------------------------------------------------------------------------------------------

    def _try(self, why: str) -> None:
        said = self.failure
        try:
            self._reform(why, None)
        except PrimaplugError as e:
            self._retry_at = time.monotonic() + RETRY_S
            if self.failure != said:  # once per failure, not at every retry while it lasts
                log.warning("could not re-form the ring (%s): %s", why, e)

    def _note_taken(self, taken: Sequence[tuple[NodeClient, Holder]]) -> None:
        """Say once (an event, a log line) that each of these nodes was taken over by another head."""
        for n, by in taken:
            if self._taken.get(n.name) != by.head.id:
                self._taken[n.name] = by.head.id
                message = f"taken over by {by.describe()}: this head leaves it alone and takes it back once it is free"
                log.warning("node %s %s", n, message)
                self.events.publish(NodeProgress(n.name, "taken", 0.0, message))

    def _reform(self, why: str, error: BaseException | None) -> Driver:
        c = self.cluster
        t0 = time.perf_counter()
        # the node the request's watch found silent for the whole timeout is not asked again
        named = error.node if isinstance(error, NodeUnavailableError) else None
        gone = [n for n in c.nodes if n.name == named]
        found = c.survey(min(SURVEY_S, c.settings.timeout_s), skip=gone)
        lost, stale = gone + found.lost, found.stale
        taken = [n for n, _ in found.taken]
        self._note_taken(found.taken)
        joined = self._arrivals()
        if not lost and not stale and not taken and not joined:
            self.pending, self._pending_since = None, 0.0
            if error is None or isinstance(error, NodeUnavailableError) or getattr(error, "code", "") == "lost":
                # every node answers ready with this assignment: the ring works (a message lost in a short network
                # drop, or the node that was slow answers again): the same ring, where the session replays
                return self.current()
            raise error  # a node refused a message, with every node there: the request's own error
        for n in stale:  # it restarted: its ring port may have changed
            try:
                n.hello()
            except (NodeError, NodeUnavailableError, ProtocolError):
                lost.append(n)
        nodes = [n for n in c.nodes if n not in lost and n not in taken] + joined
        if taken and not nodes:  # nothing to run the model on: wait until the nodes are free (the heartbeat looks)
            self.failure = (f"every node of the ring was taken over by another head: {', '.join(map(str, taken))} by "
                            f"{found.taken[0][1].describe()}. This head waits, and takes them back once that head "
                            f"lets them go (it closes, or is silent for {HEAD_LEASE_S:g} s)")
            old, self.ring = self.ring, _Broken(c.epoch, self.failure, "taken")
            old.close()
            raise NodeError("ring", "taken", self.failure)
        for n, name in zip(nodes, unique_names([(n.name, n.address) for n in nodes]), strict=True):
            n.name = name
        names = [n.name for n in lost + taken]
        back = [n for n in stale if n not in lost and n.name in self._taken]  # the head that took them let them go
        restarted = [n for n in stale if n not in lost and n not in back]
        what = "; ".join(filter(None, [
            f"lost {', '.join(n.name for n in lost)}" if lost else "",
            f"{', '.join(n.name for n in taken)} taken over by another head" if taken else "",
            f"{', '.join(n.name for n in back)} let go by the head that took them" if back else "",
            f"{', '.join(n.name for n in restarted)} restarted" if restarted else "",
            f"{', '.join(n.name for n in joined)} joined" if joined else ""]))
        self.events.publish(Notice(f"re-forming the ring: {what} ({why})"))
        survey_s = time.perf_counter() - t0
        try:
            split = self.replanner.split(c, nodes)
            plan_s = time.perf_counter() - t0 - survey_s
            old, self.ring = self.ring, _Broken(c.epoch, f"the ring is being re-formed ({what})")
            old.close()  # its steps fail; their sessions find it replaced and wait here for the new ring
            c.reform(split.nodes, split.sizes, split.gpu, [*lost, *taken], rooms=split.rooms)
            self.ring = self.open_ring(c)
        except PrimaplugError as e:
            self.failure = f"the ring could not be re-formed after it {what}: {e}"
            if self.replanner.refused(e):
                self.failure += " (the next try gives it no GPU layers)"
            self.ring = _Broken(c.epoch, self.failure)
            for n in lost + taken:
                self._departed.setdefault(n.address, n)
            raise NodeError("ring", "reform_failed", self.failure) from e
        load_s = time.perf_counter() - t0 - survey_s - plan_s
        for n in lost + taken:
            self._departed.setdefault(n.address, n)
        for n in c.nodes:  # in the ring again: ours
            self._departed.pop(n.address, None)
            self._taken.pop(n.name, None)
        self.pending = self.failure = None
        self._pending_since = 0.0
        plan = ", ".join(f"{n.name} {s}" for n, s in zip(split.nodes, split.sizes, strict=True))
        report = Reformed(f"{what} ({why})", tuple(names), tuple(n.name for n in joined),
                          f"{plan} layers per round, head {c.head_size}, assignment {c.epoch}: {split.how}", c.epoch,
                          survey_s, plan_s, load_s)
        self.reports.append(report)
        self.events.publish(report)
        log.info("ring re-formed in %.2f s (survey %.2f, plan %.2f, load %.2f): %s; %s", report.seconds, survey_s,
                 plan_s, load_s, what, report.plan)
        return self.current()

    def _arrivals(self) -> list[NodeClient]:
        """Nodes outside the ring that answer a hello with the head's model and that no other head holds: lost ones
        back, taken ones let go, or new ones found."""
        c, ring = self.cluster, {n.address for n in self.cluster.nodes}
        addresses = list(self._departed)
        if self.candidates is not None:
            addresses += [a for a in self.candidates() if a not in addresses]
        found = []
        for a in addresses:
            if a in ring or (c.transport.keys is None and not is_loopback(split_address(a)[0])):
                continue  # off this machine a node must prove it holds the cluster key (CurveZMQ), as at the start
            n = self._departed.get(a) or c.client(a)
            try:
                w = n.hello()
                free = n.taken_by(n.status(timeout_s=SURVEY_S)) is None
            except (NodeError, NodeUnavailableError, ProtocolError):
                if a not in self._departed:
                    n.close()
                continue
            if c.can_serve(w) and free:
                found.append(n)  # it leaves _departed once the ring it joins is deployed
            elif a not in self._departed:
                n.close()
        return found

    # --- the heartbeat -----------------------------------------------------------------------------------------

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            if not self._lock.acquire(blocking=False):
                continue  # a re-forming is under way
            try:
                self._beat()
            except Exception:  # the heartbeat must outlive anything one beat meets
                log.exception("heartbeat")
            finally:
                self._lock.release()

    def _beat(self) -> None:
        c = self.cluster
        if self.ring.busy:
            # a request's watch asks the ring's nodes meanwhile, and a survey would hold their sockets a second behind
            # it: only a status request that waits for nothing, so that the nodes hear from their head even while it
            # computes a long window of its own (it keeps them: node/owner.py)
            for n in c.nodes:
                n.poll_probe()
                n.probe()
            found = None
        else:
            found = c.survey(min(SURVEY_S, c.settings.timeout_s))
        if found is not None and (found.lost or found.stale or found.taken):
            self._note_taken(found.taken)
            self.pending = "; ".join(
                [f"{n} does not answer" for n in found.lost] + [f"{n} is held by another head" for n, _ in found.taken]
                + [f"{n} answers without this ring's windows" for n in found.stale])
        elif self._departed or self.candidates is not None:
            back = [a for a in [*self._departed, *(self.candidates() if self.candidates else ())]
                    if a not in {n.address for n in c.nodes} and self._answers(a)]
            if back:
                self.pending = f"{', '.join(back)} answer{'s' if len(back) == 1 else ''}"
        now = time.monotonic()
        if self.pending is None:
            return
        if not self._pending_since:
            self._pending_since = now
        # a head that took nodes lets them go one after the other: while some of them are free and others not yet,
        # wait a beat, rather than re-form over the first alone and again once the rest follow
        settling = found is not None and found.taken and any(n.name in self._taken for n in found.stale)
        if not settling:
            self._settling_since = 0.0
        elif not self._settling_since or now - self._settling_since < BOUNDARY_WAIT_S:
            self._settling_since = self._settling_since or now
            return
        if (self.idle() or now - self._pending_since > BOUNDARY_WAIT_S) and now >= self._retry_at:
            self._try(self.pending)

    def _answers(self, address: str) -> bool:
        n = self._departed.get(address)
        if n is None:
            return True  # found by discovery: a hello will tell
        try:
            st = n.status(timeout_s=SURVEY_S / 4)
        except (NodeError, NodeUnavailableError, ProtocolError):
            return False
        return n.taken_by(st) is None  # one another head holds is not back yet
