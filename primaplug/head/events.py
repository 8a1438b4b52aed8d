"""What the head publishes while it works: typed events, and the snapshot of the cluster they add up to.

The cluster (connecting, profiling, loading), the planner and each request's session publish events on one
`Events` bus; whoever shows them (the CLI's lines and bars, the dashboard) subscribes, and nothing in the head
prints. `Events.view` is the latest `ClusterView`, made by applying each event in turn (`apply`, a pure function).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from primaplug.core.windows import LayerRange
from primaplug.wire import Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeProgress:
    """A node's state changed, or it made progress: connecting, profiling itself, loading its windows."""

    node: str
    state: str  # "connected", "profiling", "loading", "ready", "failed", "left", "taken" (by another head)
    progress: float = 0.0  # 0 to 1, within the state
    message: str = ""


@dataclass(frozen=True)
class Notice:
    """A step of the head's own work worth telling (planning, profiling the head, measuring links)."""

    message: str


@dataclass(frozen=True)
class Planned:
    """The scheduler made a plan (described in words: windows per device, predicted time per token)."""

    description: str


@dataclass(frozen=True)
class Deployed:
    """Every node has loaded its windows; the ring is ready."""

    nodes: tuple[tuple[str, tuple[LayerRange, ...]], ...]  # (node, its window per round), in ring order
    head: tuple[LayerRange, ...]  # the head's windows per round (empty ranges: only the output layer)
    seconds: float


@dataclass(frozen=True)
class Reformed:
    """The ring was re-formed: nodes were lost or joined, the devices there are were planned again and loaded, under
    a new assignment. The requests in flight replay their prefix onto it and go on."""

    why: str  # what was noticed: the node lost (and how), or the node that joined
    lost: tuple[str, ...]
    joined: tuple[str, ...]
    plan: str  # the new windows, in words (and how they were chosen)
    epoch: int
    survey_s: float  # asking every node whether it is there
    plan_s: float  # re-planning
    load_s: float  # the nodes loading their new windows

    @property
    def seconds(self) -> float:
        return self.survey_s + self.plan_s + self.load_s


@dataclass(frozen=True)
class BatchDone:
    """One batch went round the ring (a prompt's batch, or one decoded token)."""

    step: int
    pos0: int
    n_tokens: int
    seconds: float


@dataclass(frozen=True)
class SessionChanged:
    """The session's prefix changed other than by a batch: rewound, cleared, replayed, or lost in a failure."""

    what: str  # "rewind", "clear", "replay", "failed"
    n_past: int  # positions the ring's caches hold after it
    detail: str = ""


@dataclass(frozen=True)
class NodeMetrics:
    """A node's detailed status (memory mode, prefetch, faults, pressure), as it answered GetStatus."""

    node: str
    status: Status
    busy_share: float = 0.0  # the share of the time since the last report the node spent running windows


Event = NodeProgress | Notice | Planned | Deployed | Reformed | BatchDone | SessionChanged | NodeMetrics


@dataclass(frozen=True)
class NodeView:
    state: str = "connected"
    progress: float = 0.0
    message: str = ""
    windows: tuple[LayerRange, ...] = ()
    metrics: Status | None = None
    busy_share: float = 0.0


@dataclass(frozen=True)
class ClusterView:
    """The cluster as the head last heard of it: an immutable snapshot."""

    nodes: dict[str, NodeView] = field(default_factory=dict)
    plan: str = ""
    head_windows: tuple[LayerRange, ...] = ()
    deployed: bool = False
    n_past: int = 0  # positions the ring's caches hold
    prompt_tokens: int = 0  # tokens evaluated in batches of more than one
    prompt_s: float = 0.0
    decoded_tokens: int = 0  # tokens evaluated one at a time
    decode_s: float = 0.0
    notice: str = ""
    reforms: int = 0  # times the ring was re-formed (nodes lost or joined)

    @property
    def tpot_s(self) -> float:
        return self.decode_s / self.decoded_tokens if self.decoded_tokens else 0.0


def apply(view: ClusterView, event: Event) -> ClusterView:
    """The view after one event."""
    match event:
        case NodeProgress(node=node):
            old = view.nodes.get(node, NodeView())
            new = replace(old, state=event.state, progress=event.progress, message=event.message,
                          windows=() if event.state == "taken" else old.windows)
            return replace(view, nodes={**view.nodes, node: new})
        case NodeMetrics(node=node):
            old = view.nodes.get(node, NodeView())
            new = replace(old, metrics=event.status, busy_share=event.busy_share)
            return replace(view, nodes={**view.nodes, node: new})
        case Notice():
            return replace(view, notice=event.message)
        case Planned():
            return replace(view, plan=event.description)
        case Deployed():
            # a node of an earlier ring that is not in this one holds no window of it
            nodes = {name: replace(v, windows=()) for name, v in view.nodes.items()}
            for name, windows in event.nodes:
                nodes[name] = replace(nodes.get(name, NodeView()), state="ready", progress=1.0, windows=windows)
            return replace(view, nodes=nodes, head_windows=event.head, deployed=True)
        case BatchDone():
            n_past = event.pos0 + event.n_tokens
            if event.n_tokens > 1:
                return replace(view, n_past=n_past, prompt_tokens=view.prompt_tokens + event.n_tokens,
                               prompt_s=view.prompt_s + event.seconds)
            return replace(view, n_past=n_past, decoded_tokens=view.decoded_tokens + 1,
                           decode_s=view.decode_s + event.seconds)
        case SessionChanged():
            return replace(view, n_past=event.n_past)
        case Reformed():
            nodes = {**view.nodes}
            for name in event.lost:  # out of the ring: shown failed, with why, until it answers again
                nodes[name] = replace(nodes.get(name, NodeView()), state="failed", windows=(),
                                      message=f"left out of the ring: {event.why}")
            return replace(view, nodes=nodes, notice=f"ring re-formed in {event.seconds:.1f} s: {event.why}",
                           reforms=view.reforms + 1)
    return view


Subscriber = Callable[[Event], None]


class Events:
    """The head's event bus: publish() calls every subscriber, in the publishing thread, and updates `view`."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self.view = ClusterView()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call `subscriber` with every event from now on; returns the function that stops it."""
        with self._lock:
            self._subscribers.append(subscriber)
        return lambda: self._unsubscribe(subscriber)

    def _unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    def publish(self, event: Event) -> None:
        with self._lock:
            self.view = apply(self.view, event)
            subscribers = list(self._subscribers)
        for s in subscribers:
            try:
                s(event)
            except Exception:  # a subscriber's bug must not stop the ring
                log.exception("an event subscriber failed on %s", type(event).__name__)


class TokenClock:
    """Times generation from the session's batches, the same way for every front (the dashboard, benchmarks):
    subscribe it, call start() as a request begins; TTFT runs to the end of the prompt's last batch, and each
    one-token batch after it is one more generated token (the interval between their ends is the TPOT)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.start()

    def start(self) -> None:
        with self._lock:
            self.t0 = time.perf_counter()
            self.first: float | None = None  # when the prompt's last batch ended
            self.ends: list[float] = []  # when each generated token's batch ended

    def __call__(self, event: Event) -> None:
        if not isinstance(event, BatchDone):
            return
        now = time.perf_counter()
        with self._lock:
            if event.n_tokens > 1 or self.first is None:
                self.first, self.ends = now, []
            else:
                self.ends.append(now)

    @property
    def ttft_s(self) -> float:
        return (self.first - self.t0) if self.first is not None else 0.0

    @property
    def intervals_s(self) -> list[float]:
        """Each generated token's time, in order."""
        with self._lock:
            marks = [self.first, *self.ends] if self.first is not None else []
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    @property
    def tpot_s(self) -> float:
        gaps = self.intervals_s
        return sum(gaps) / len(gaps) if gaps else 0.0

    @property
    def tokens(self) -> int:
        """Batches evaluated since the prompt: the tokens generated, less the last (sampled, not evaluated)."""
        return len(self.ends)
