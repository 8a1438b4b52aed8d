"""What `GET /metrics` says, in Prometheus' text format (version 0.0.4), written here: the format is a few lines
of text, and prometheus_client would be one more dependency for them.

The server measures each request as its client sees it: a stream's time to first token and time per output token
from when its chunks are ready to send, a request that is not streamed by its total time and its usage. The ring's
side (requests holding or waiting for a sequence, the nodes' state and memory) is read from the Llama when scraped
(`RingFigures`).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# seconds; a ring of home devices answers in tens of ms per token to seconds per prompt
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 60.0  # tokens per second over the last minute

OUTCOMES = ("ok", "error", "unavailable", "disconnected", "interrupted")


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def samples(self, name: str, labels: dict[str, str]) -> list[tuple[str, dict[str, str], float]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append((f"{name}_bucket", {**labels, "le": _number(bound)}, running))
        return [*out, (f"{name}_sum", labels, self.total), (f"{name}_count", labels, running)]


@dataclass(frozen=True)
class NodeFigures:
    name: str
    state: str
    status: Any = None  # the node's last detailed status (wire.Status), None before it answered one


@dataclass(frozen=True)
class RingFigures:
    """The ring's side, read from the Llama when scraped."""

    n_parallel: int
    running: int  # requests holding a sequence
    waiting: int  # requests waiting for one (in the Llama, or for a worker thread before it)
    ready: bool
    prompt_tokens: int  # evaluated on the ring since the Llama started
    nodes: tuple[NodeFigures, ...] = ()


@dataclass
class Request:
    """One request, as the server measures it; `Metrics.end` records it once."""

    endpoint: str
    stream: bool
    t0: float
    first: float | None = None  # when its first generated text was ready
    last: float | None = None
    tokens: int = 0
    outcome: str = "ok"
    _done: bool = field(default=False, repr=False)


class Metrics:
    """The server's own counters; thread-safe (requests run in worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.in_flight = 0
        self.requests: dict[tuple[str, str], int] = {}
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.duration = {False: Histogram(DURATION_BUCKETS), True: Histogram(DURATION_BUCKETS)}
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) over the last RATE_WINDOW_S
        self._states: dict[str, dict[str, None]] = {}  # every state each node was seen in, in order

    def start(self, endpoint: str, stream: bool) -> Request:
        with self._lock:
            self.in_flight += 1
        return Request(endpoint, stream, time.monotonic())

    def chunk(self, request: Request, tokens: int = 1) -> None:
        """A streamed chunk that carries generated text (llama-cpp-python streams one per token, except where it
        holds text back for a stop string or an unfinished character)."""
        now = time.monotonic()
        if request.first is None:
            request.first = now
        request.last = now
        request.tokens += tokens
        with self._lock:
            self.generated_tokens += tokens
            self._add_recent(now, tokens)

    def usage(self, request: Request, completion_tokens: int) -> None:
        """A request that was not streamed: its generated tokens, counted when it ends."""
        now = time.monotonic()
        request.tokens += completion_tokens
        with self._lock:
            self.generated_tokens += completion_tokens
            self._add_recent(now, completion_tokens)

    def end(self, request: Request, outcome: str | None = None) -> None:
        if outcome is not None:
            request.outcome = outcome
        now = time.monotonic()
        with self._lock:
            if request._done:
                return
            request._done = True
            self.in_flight -= 1
            key = (request.endpoint, request.outcome)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.duration[request.stream].observe(now - request.t0)
            if request.stream and request.first is not None:
                self.ttft.observe(request.first - request.t0)
                if request.tokens > 1 and request.last is not None:
                    self.tpot.observe((request.last - request.first) / (request.tokens - 1))

    def _add_recent(self, now: float, tokens: int) -> None:
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens over the last minute (over the time since start, in the first minute)."""
        now = time.monotonic()
        with self._lock:
            self._add_recent(now, 0)
            tokens = sum(n for _, n in self._recent)
        return tokens / max(1e-9, min(RATE_WINDOW_S, now - self.started))

    def render(self, ring: RingFigures) -> str:
        """The text of GET /metrics."""
        rate = self.tokens_per_second()
        with self._lock:
            requests = dict(self.requests)
            families = [
                ("primaplug_requests_in_flight", "gauge", "Requests the server is handling (running or waiting).",
                 [("", {}, self.in_flight)]),
                ("primaplug_requests_running", "gauge", "Requests holding a sequence on the ring.",
                 [("", {}, ring.running)]),
                ("primaplug_requests_waiting", "gauge", "Requests waiting for a free sequence.",
                 [("", {}, ring.waiting)]),
                ("primaplug_parallel_sequences", "gauge", "Sequences on the ring: requests served at once (-np).",
                 [("", {}, ring.n_parallel)]),
                ("primaplug_requests_total", "counter",
                 "Requests ended, by endpoint and outcome (ok, error, unavailable: refused with 503 as no ring was "
                 "ready, disconnected: the client left, interrupted: --interrupt_requests).",
                 [("", {"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(requests.items())]),
                ("primaplug_generated_tokens_total", "counter",
                 "Tokens generated: usage of requests not streamed, chunks with text of streams.",
                 [("", {}, self.generated_tokens)]),
                ("primaplug_prompt_tokens_total", "counter",
                 "Prompt tokens evaluated on the ring (a prefix a sequence already holds is not evaluated again).",
                 [("", {}, ring.prompt_tokens)]),
                ("primaplug_tokens_per_second", "gauge", "Tokens generated per second over the last minute.",
                 [("", {}, rate)]),
                ("primaplug_time_to_first_token_seconds", "histogram",
                 "Streamed requests: from the request to its first generated text.",
                 self.ttft.samples("primaplug_time_to_first_token_seconds", {})),
                ("primaplug_time_per_output_token_seconds", "histogram",
                 "Streamed requests: the time between their first and last generated text, per token after the first.",
                 self.tpot.samples("primaplug_time_per_output_token_seconds", {})),
                ("primaplug_request_duration_seconds", "histogram", "Requests, from arrival to their last byte.",
                 [s for stream in (False, True)
                  for s in self.duration[stream].samples("primaplug_request_duration_seconds",
                                                         {"stream": str(stream).lower()})]),
                ("primaplug_ring_ready", "gauge", "1 when every node answers ready with the current assignment.",
                 [("", {}, int(ring.ready))]),
            ]
            for node in ring.nodes:
                self._states.setdefault(node.name, {})[node.state] = None
            states = [("", {"node": n.name, "state": s}, int(s == n.state))
                      for n in ring.nodes for s in self._states[n.name]]
        families.append(("primaplug_node_state", "gauge", "1 for the state each node is in, 0 for those it was in.",
                         states))
        for name, attribute, help_text in (
                ("primaplug_node_memory_pressure_ratio", "memory_pressure",
                 "Drop in the node's available memory since it started, over its total memory."),
                ("primaplug_node_resident_bytes", "resident_bytes", "Bytes of the node's windows resident in memory."),
                ("primaplug_node_memory_budget_bytes", "memory_budget_bytes",
                 "What the node's windows' weights may use."),
                ("primaplug_node_major_faults_per_token", "major_faults_per_token",
                 "Major page faults per token while the node computes (streamed windows).")):
            families.append((name, "gauge", help_text,
                             [("", {"node": n.name}, getattr(n.status, attribute))
                              for n in ring.nodes if n.status is not None]))
        return "".join(_family(*f) for f in families)


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> str:
    lines = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} {kind}"]
    for sample_name, labels, value in samples:
        label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
        lines.append(f"{sample_name or name}{'{' + label_text + '}' if label_text else ''} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
