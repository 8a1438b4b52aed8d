"""The node daemon: a control loop (main thread), a ring loop (its own thread) and a loader (one per load).

The control loop always answers, also while the ring loop computes or a load runs, so the head can tell a
busy node from a dead one. The ring loop owns the compute: one message at a time, under the deployment lock
that a load takes to swap deployments.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from primaplug import __version__
from primaplug.core.errors import ConfigError, ModelFormatError, PrimaplugError, ProtocolError, no_gpu_backend
from primaplug.core.settings import DEFAULT_PORT, HEAD_LEASE_S, HEAD_SILENCE_S, MAX_PARALLEL, TIMEOUT_S, usable_cores
from primaplug.core.windows import LayerRange
from primaplug.device import MemorySettings
from primaplug.device.memory import reserved_bytes
from primaplug.engine import ModelLayout, cpu_kernels, read_layout
from primaplug.memory.system import memory_view
from primaplug.node.deployment import Deployment
from primaplug.node.files import HeldFile
from primaplug.node.owner import Ownership
from primaplug.node.profiling import Profiling
from primaplug.profiler import gpu
from primaplug.store import Fetcher, SparseCopy, Store, answer, header_pieces, needed_pieces
from primaplug.transport import ControlServer, RingIn, Transport, is_loopback
from primaplug.transport.addresses import parse_endpoint
from primaplug.wire import (
    PROTOCOL_VERSION,
    Activation,
    Assignment,
    ControlReply,
    DeviceFacts,
    ErrorReply,
    FileSource,
    GetManifest,
    GetProfile,
    GetStatus,
    HeadTag,
    HeldCopy,
    Hello,
    KvOp,
    LoadAssignment,
    ModelIdentity,
    ProfileReply,
    ReadPiece,
    RingError,
    RingFrameError,
    Shutdown,
    Status,
    Unload,
    Welcome,
    decode_request,
    decode_ring,
    encode,
    encode_ring,
)

log = logging.getLogger(__name__)
# compute threads a load may ask for, per core of the device: more only thrashes (100000 once made a node stop
# answering while the machine's load climbed into the thousands)
THREADS_PER_CORE = 4
MAX_COUNT = 2**31 - 1  # context and batch sizes: llama.cpp keeps them in 32 bits (ctypes would wrap larger ones)
PAIR_TRIES = 50  # random control ports tried until the next one up is free too
MAX_ENDPOINT_CHARS = 300  # a host name of at most 253 characters, a port and the scheme
MAX_MESSAGE_CHARS = 600  # of a refusal's message (it may quote what the peer sent)
# once asked to stop, how long the node waits for its ring thread and a load to finish before it frees what it can
# and exits anyway (the process's exit frees the rest)
STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class NodeSettings:
    models: tuple[Path, ...]  # the only model files this node will ever open (besides its model folder's copies)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # control; the ring listens on port + 1 (port 0: a free pair)
    name: str = field(default_factory=platform.node)
    secure: bool = False  # whether the transport was given the cluster keys
    send_timeout_s: float = TIMEOUT_S  # how long a ring send waits for a successor before giving up
    memory: MemorySettings = MemorySettings()
    profile_dir: Path | None = None  # where the device profile is cached (default ~/.cache/primaplug/profiles)
    pin_threads: bool | None = None  # compute threads on a core each: None when they use every core (--cpu-strict)
    # seconds without a control request or ring message after which a node frees its windows (its head has gone;
    # a running head asks for a status every second); 0: never (--release-after)
    release_after_s: float = HEAD_SILENCE_S
    lease_s: float = HEAD_LEASE_S  # a head that deployed the node holds it while it speaks this often (node/owner.py)
    exit_with_parent: bool = False  # stop when the process that started the node ends (a head's local nodes)
    # where the node keeps the parts of models it fetches from the cluster (--model-dir; primaplug/store), and what
    # they may take on its disk (--disk-budget; None: the disk's free space at start, less a margin)
    model_dir: Path | None = None
    disk_budget_bytes: int | None = None

    def check(self) -> None:
        if not self.models and self.model_dir is None:
            raise ConfigError("a node needs a model: --model FILE, or --model-dir DIR to fetch the layers it runs "
                              "from the head")
        if self.disk_budget_bytes is not None and (self.model_dir is None or self.disk_budget_bytes <= 0):
            raise ConfigError("--disk-budget is the room of the model folder: give --model-dir, and a size of 1 MiB "
                              "or more")
        if not self.release_after_s >= 0:  # NaN too
            raise ConfigError(f"--release-after must be 0 (never) or a number of seconds, not {self.release_after_s}")
        for m in self.models:
            if not m.is_file():
                raise ConfigError(f"model file {m} does not exist")
        if not self.secure and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host} without encryption: make a cluster key with "
                "`primaplug keygen cluster.key`, copy it to every device, and start each node and the head "
                "with --keys cluster.key (or listen on 127.0.0.1)"
            )


def _listen(transport: Transport, host: str, port: int) -> tuple[ControlServer, RingIn]:
    """Bind the control server on port and the ring input on port + 1. Port 0 picks a free pair rather than two
    unrelated ports, so that a node restarted on its control address (--listen HOST:PORT) finds its ring port free
    again, not one some other socket took while it was down."""
    for _ in range(PAIR_TRIES if port == 0 else 1):
        control = transport.control_server(host, port)
        try:
            return control, transport.ring_in(host, parse_endpoint(control.address)[1] + 1)
        except ConfigError:
            control.close()
            if port:
                raise
    raise ConfigError(f"found no two free consecutive ports on {host} in {PAIR_TRIES} tries: give one with --listen")


class Node:
    def __init__(self, settings: NodeSettings, transport: Transport) -> None:
        settings.check()
        self.settings = settings
        self.name = settings.name
        self.transport = transport
        self._kernels = cpu_kernels()  # what Welcome reports: the head compares them (mixed CPUs)
        self._models: dict[str, tuple[HeldFile, ModelLayout, ModelIdentity]] = {}
        self._store: Store | None = None  # the model folder (--model-dir), where fetched layers are kept
        try:
            if settings.model_dir is not None:
                self._store = Store(settings.model_dir, settings.disk_budget_bytes)
            for path in settings.models:
                held = HeldFile(path)  # every later read goes through this open file (node/files.py)
                try:
                    layout = read_layout(held.path)
                    layout.check_supported()
                except ModelFormatError as e:
                    held.close()
                    raise ModelFormatError(str(path), e.reason) from None
                except BaseException:
                    held.close()
                    raise
                if layout.identity in self._models:  # the same model twice (a copy, or two names of one file)
                    held.close()
                    continue
                self._models[layout.identity] = (held, layout, ModelIdentity.of(layout, held.name))
            self.control, self.ring = _listen(transport, settings.host, settings.port)
        except BaseException:
            self._close_models()
            raise
        self._lock = threading.Lock()  # held by the ring loop while it computes, and by a load while it swaps
        self._deployment: Deployment | None = None
        self._stop = threading.Event()
        self._stop_reason = "asked to stop"
        self._owner = Ownership(settings.lease_s)
        self._parent = os.getppid() if settings.exit_with_parent else 0
        self._status = Status(node=self.name, state="idle")
        self._activity = ""
        self._last_step = -1
        self._steps_done = 0
        self._busy_s = 0.0
        self._kv_positions = 0
        self._loader: threading.Thread | None = None
        self._ring_thread: threading.Thread | None = None
        self._used_at_start = memory_view().used_bytes  # memory pressure counts from here
        self._profiling = Profiling(self.name, settings.profile_dir)
        self._contact = time.monotonic()  # when a head last sent anything (a control request or a ring message)
        self._in_use: dict[str, set[int]] = {}  # pieces of its model folder's copies that the loaded windows map
        self._fetching = threading.Lock()  # one fetch into the model folder at a time (a profile's, a load's)
        self._header: threading.Thread | None = None  # fetching a model's header for a profile request
        self._header_error: tuple[str, str] = ("", "")  # (model, why) of the last header fetch that failed
        self._fetched_bytes = 0
        self._fetch_s = 0.0

    # --- main loop -----------------------------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until a Shutdown request or stop(); then free everything, waiting at most STOP_GRACE_S for the ring
        thread and a load to finish (what is still in use then is left to the process's exit: lingering())."""
        ring = self._ring_thread = threading.Thread(target=self._ring_loop, name="ring", daemon=True)
        ring.start()
        log.info("node %s ready: control %s, ring %s", self.name, self.control.address, self.ring.address)
        try:
            while not self._stop.is_set():
                if self._parent and os.getppid() != self._parent:
                    self.stop(f"the process that started it (pid {self._parent}) has ended")
                    break
                got = self.control.recv(0.2)
                if got is None:
                    continue
                envelope, body = got
                reply = self._handle_control(body)
                self.control.reply(envelope, encode(reply))
        finally:
            self._stop.set()
            doing = self._activity or (self._status.message if self._status.state == "loading" else "")
            log.info("node %s stopping (%s)%s", self.name, self._stop_reason, f" while {doing}" if doing else "")
            deadline = time.monotonic() + STOP_GRACE_S
            ring.join(timeout=STOP_GRACE_S)
            if self._loader is not None:
                self._loader.join(timeout=max(0.0, deadline - time.monotonic()))
            if self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    self._drop_deployment()
                finally:
                    self._lock.release()
            if self.lingering():
                log.warning("node %s: still %s after %.0f s; exiting without waiting for it", self.name,
                            self._activity or "loading", STOP_GRACE_S)
            else:  # the sockets are closed by the thread that made them, once no other thread uses them
                self.control.close()
                self.ring.close()
                self._close_models()
            log.info("node %s stopped", self.name)

    def stop(self, reason: str = "asked to stop") -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def store(self) -> Store | None:
        """The model folder that fetched layers go to, with its disk budget; None without --model-dir."""
        return self._store

    def lingering(self) -> bool:
        """Whether the ring thread or a load still runs after serve() returned: the process must then end without
        waiting for them (os._exit)."""
        return any(t is not None and t.is_alive() for t in (self._ring_thread, self._loader))

    def _close_models(self) -> None:
        for held, _, _ in self._models.values():
            held.close()
        if self._store is not None:
            self._store.close()

    def _drop_deployment(self) -> None:
        """Free the current windows (the caller holds the deployment lock)."""
        if self._deployment is not None:
            self._deployment.close()
            self._deployment = None

    # --- control -------------------------------------------------------------------------------------------

    def _error(self, code: str, message: str, retryable: bool = False) -> ErrorReply:
        message = _brief(message)
        log.warning("control request refused (%s): %s", code, message)
        return ErrorReply(node=self.name, code=code, message=message, retryable=retryable)

    def _handle_control(self, body: bytes) -> ControlReply:
        try:
            req = decode_request(body)
        except ProtocolError as e:
            return self._error("bad_message", str(e))
        if isinstance(req, GetManifest | ReadPiece):  # a peer fetching what this node's copies hold
            try:
                return answer(req, self.name, self._store.copies.get if self._store else lambda _m: None)
            except OSError as e:  # its disk failed: the peer asks the next holder
                return self._error("internal", f"could not read piece {getattr(req, 'index', '')}: {e}")
        if not isinstance(req, Hello):  # a Hello (a health check, a head looking for nodes) is not a head's word
            self._contact = time.monotonic()
        self._owner.heard(getattr(req, "head", None))
        try:
            match req:
                case Hello():
                    if req.proto != PROTOCOL_VERSION:
                        older = "this node" if req.proto > PROTOCOL_VERSION else "the head"
                        return self._error("protocol_version", f"the head speaks protocol {req.proto}, this node "
                                           f"{PROTOCOL_VERSION}: upgrade {older} (primaplug {__version__} here)")
                    return self._welcome()
                case LoadAssignment():
                    return self._held(req.head, "load windows", req.take_over) or self._load(req)
                case GetStatus():
                    return self.status(detail=req.detail)
                case GetProfile():
                    if held := self._held(req.head, "profile it", req.take_over):
                        return held
                    self._owner.claim(req.head, self.name)
                    return self._profile(req)
                case Unload():
                    if held := self._held(req.head, "free its windows", req.take_over):
                        return held
                    with self._lock:
                        self._drop_deployment()
                        self._status = Status(node=self.name, state="idle")
                    if req.release:
                        self._owner.release(req.head, self.name)
                    else:
                        self._owner.claim(req.head, self.name)
                    return self.status()
                case Shutdown():
                    if held := self._held(req.head, "shut it down", req.take_over):
                        return held
                    who = f"head {req.head.id[:8]} ({req.head.name})" if req.head else "a head"
                    self.stop(f"{who} asked it to shut down")
                    return self.status()
        except PrimaplugError as e:
            return self._error("bad_request", str(e))
        except Exception as e:  # a process boundary: report and keep serving
            log.exception("control request failed")
            return self._error("internal", f"{type(e).__name__}: {e}")
        return self._error("bad_message", f"unhandled request {type(req).__name__}")

    def _held(self, head: HeadTag | None, what: str, take_over: bool) -> ErrorReply | None:
        """The refusal of a request that would change what the node does while another head holds it."""
        why = self._owner.refusal(head, what, take_over)
        if not why:
            return None
        reply = self._error("held", why)
        return msgspec.structs.replace(reply, holder=self._owner.holder())

    def _welcome(self) -> Welcome:
        mem = memory_view()  # what this node budgets with, and its profile reports to the planner
        facts = DeviceFacts(os=platform.system(), machine=platform.machine(), cpu_count=usable_cores(),
                            mem_total_bytes=mem.total_bytes, mem_available_bytes=mem.available_bytes,
                            kernels=self._kernels,
                            disk_budget_bytes=self._store.budget_bytes if self._store else 0)
        copies = tuple(HeldCopy(model=c.identity, units=c.held_units())
                       for c in (self._store.copies.values() if self._store else ()))
        return Welcome(proto=PROTOCOL_VERSION, software=__version__, node=self.name,
                       models=tuple(m for _, _, m in self._models.values()), device=facts,
                       ring_endpoint=self.ring.address, copies=copies)

    def status(self, detail: bool = False) -> Status:
        s = self._status
        status = Status(node=self.name, state=s.state, epoch=s.epoch, progress=s.progress, message=s.message,
                        activity=self._activity, last_step=self._last_step, steps_done=self._steps_done,
                        busy_s=self._busy_s, kv_positions=self._kv_positions, holder=self._owner.holder(),
                        fetched_bytes=self._fetched_bytes, fetch_s=self._fetch_s)
        if self._store is not None:
            status = msgspec.structs.replace(status, disk_bytes=self._store.disk_bytes(),
                                             disk_budget_bytes=self._store.budget_bytes)
        dep = self._deployment
        if detail and dep is not None and dep.prefetcher is not None:
            p = dep.prefetcher
            p.wait_idle(2.0)  # the measurements of a settled device: a release may still be under way after a token
            pressure = memory_view().pressure_since(self._used_at_start)
            status = msgspec.structs.replace(
                status, memory_mode=dep.device.memory_mode, bytes_prefetched=p.stats.bytes_prefetched,
                bytes_released=p.stats.bytes_released, major_faults_per_token=p.stats.major_faults_per_token,
                resident_bytes=p.resident_bytes(), memory_pressure=pressure,
                memory_budget_bytes=dep.device.budget_bytes, experts=dep.expert_traffic())
        return status

    def _lacks(self, model: str, what: str, source: FileSource | None) -> ErrorReply | None:
        """The refusal of a request for a model this node neither holds nor may fetch (None when it may go on)."""
        if model in self._models or (self._store is not None and source is not None):
            return None
        held = ", ".join(f"{m.file_name} ({m.identity})" for _, _, m in self._models.values()) or "no model file"
        fix = ("the head gave no holder to fetch it from: upgrade the head" if self._store is not None
               else "start it with --model pointing at the head's file, or with --model-dir to fetch its layers")
        return self._error("wrong_model", f"{what} {model}; this node holds {held}: {fix}")

    def _profile(self, req: GetProfile) -> ProfileReply | ErrorReply:
        if refused := self._lacks(req.model, "asked to profile for model", req.source):
            return refused
        if self._deployment is not None:
            return self._error("busy", "this node has windows loaded, which would skew its free memory: "
                               "unload them before profiling")
        if req.model in self._models:
            held, layout, _ = self._models[req.model]
            profile, message = self._profiling.ask(Path(held.path), layout, force=req.force, shown=held.name)
            return ProfileReply(node=self.name, profile=profile, message=message)
        assert self._store is not None and req.source is not None
        copy = self._store.copies.get(req.model)
        if copy is None or copy.missing(header_pieces(copy.manifest)):
            return self._fetch_header(req.model, req.source)
        # its disk is timed in the model folder: the copy's first bytes may be holes, which read at no disk's speed
        profile, message = self._profiling.ask(None, copy.layout(), force=req.force, shown=copy.file_name)
        return ProfileReply(node=self.name, profile=profile, message=message)

    def _fetch_header(self, model: str, source: FileSource) -> ProfileReply | ErrorReply:
        """Start fetching a model's header in the background (a profile needs the layout); the head asks again."""
        failed, why = self._header_error
        if failed == model:
            self._header_error = ("", "")
            return self._error("fetch_failed", why)
        if self._header is None or not self._header.is_alive():
            def run() -> None:
                try:
                    self._copy(model, source)
                except Exception as e:  # a thread boundary: the next profile request reports it
                    log.warning("fetching the header of %s failed: %s", model, e)
                    self._header_error = (model, str(e))

            self._header = threading.Thread(target=run, name="header", daemon=True)
            self._header.start()
        return ProfileReply(node=self.name, message=f"fetching the header of {source.file_name or model}")

    def _copy(self, model: str, source: FileSource, fetcher: Fetcher | None = None) -> SparseCopy:
        """The model folder's copy of a model, with its header fetched (and checked against the identity)."""
        assert self._store is not None
        fetcher = fetcher or Fetcher(self.transport, source, model, stop=self._stop.is_set)
        with self._fetching:
            copy = self._store.copies.get(model)
            if copy is None or copy.manifest.digest() != source.manifest_sha256:
                copy = self._store.copy(fetcher.manifest(), source.file_name or model)
            header = header_pieces(copy.manifest)
            copy.verify(header)
            self._fetched_bytes += fetcher.fetch(copy, header, what=f"the header of {copy.file_name}")
            copy.layout()
            return copy

    def _load(self, req: LoadAssignment) -> Status | ErrorReply:
        a = req.assignment
        if refused := self._lacks(a.model.identity, f"the head asked for {a.model.file_name}", req.source):
            return refused
        held: HeldFile | None = None
        if a.model.identity in self._models:
            held, layout, _ = self._models[a.model.identity]
            problem = _check_assignment(a, layout)
            if problem:
                return self._error("bad_assignment", problem)
        if self._loader is not None and self._loader.is_alive():
            return self._error("busy", "a load is already running; wait for it (see status)", retryable=True)
        self._owner.claim(req.head, self.name)
        self._status = Status(node=self.name, state="loading", epoch=a.epoch, message="waiting for the ring")
        self._loader = threading.Thread(target=self._run_load, args=(a, held, req.source), name="load", daemon=True)
        self._loader.start()
        return self.status()

    def _fetch_windows(self, a: Assignment, source: FileSource,
                       progress: Callable[[float, str], None]) -> tuple[SparseCopy, ModelLayout]:
        """The copy of the assignment's model with every piece its windows read: held pieces checked (once a
        process, and again after the file changed), room made within the disk budget, the rest fetched."""
        assert self._store is not None
        model = a.model.identity
        fetcher = Fetcher(self.transport, source, model, stop=self._stop.is_set)
        progress(0.0, f"fetching the header of {a.model.file_name}")
        copy = self._copy(model, source, fetcher)
        layout = copy.layout()
        problem = _check_assignment(a, layout)
        if problem:
            raise ConfigError(f"bad assignment: {problem}")
        need = needed_pieces(layout, [il for w in a.windows for il in range(w.start, w.end)])
        with self._fetching:
            copy.verify(need)
            self._store.make_room(copy, need, self._in_use)
            t0 = time.perf_counter()
            got = fetcher.fetch(copy, need, what=copy.file_name,
                                progress=lambda p: progress(p.fraction, p.describe(copy.file_name)))
            self._fetched_bytes += got
            if got:
                self._fetch_s = time.perf_counter() - t0
                log.info("fetched %.1f MiB of %s in %.2f s (%.1f MB/s)", got / 2**20, copy.file_name, self._fetch_s,
                         got / self._fetch_s / 1e6 if self._fetch_s > 0 else 0.0)
            copy.touch(need)
            copy.save()
            self._in_use = {model: set(need)}
        return copy, layout

    def _run_load(self, a: Assignment, held: HeldFile | None, source: FileSource | None) -> None:
        def progress(frac: float, what: str) -> None:
            if self._stop.is_set():
                raise _StoppedError(f"the node stopped ({self._stop_reason})")
            self._status = Status(node=self.name, state="loading", epoch=a.epoch, progress=frac, message=what)

        def fail(message: str, trace: bool) -> None:
            log.error("loading assignment %d failed: %s", a.epoch, message, exc_info=trace)
            self._status = Status(node=self.name, state="failed", epoch=a.epoch, message=message)

        t0 = time.perf_counter()
        copy: SparseCopy | None = None
        if held is not None:
            path, layout = held.path, self._models[a.model.identity][1]
        else:  # fetched while the windows loaded before keep running
            assert source is not None
            try:
                copy, layout = self._fetch_windows(a, source, progress)
            except (PrimaplugError, OSError) as e:
                fail(str(e), trace=isinstance(e, OSError))
                return
            path = copy.reader_path
        with self._lock:  # no compute while deployments change
            self._drop_deployment()
            try:
                if held is not None:
                    held.check()
                self._deployment = Deployment.load(a, path, layout, self.transport, progress,
                                                   self.settings.memory, pin_threads=self.settings.pin_threads,
                                                   copy=copy)
                if held is not None:
                    held.check()  # where readers go by name, it must still have named the held file
            except Exception as e:
                # a file changed under the load says so, not what llama.cpp made of the bytes it found
                problem = held.problem() if held is not None else ""
                fail(problem or str(e), trace=not problem and not isinstance(e, _StoppedError))
                self._drop_deployment()
                return
            # still under the lock, so that an Unload cannot slip in between and be overwritten
            self._status = Status(node=self.name, state="ready", epoch=a.epoch, progress=1.0, message="ready")
            self._contact = time.monotonic()  # a slow load is not silence
        log.info("assignment %d loaded in %.2f s: windows %s, successor %s%s", a.epoch, time.perf_counter() - t0,
                 [(w.start, w.end) for w in a.windows], a.successor,
                 f"; the model folder takes {self._store.disk_bytes() / 2**20:.0f} of its "
                 f"{self._store.budget_bytes / 2**20:.0f} MiB on disk" if self._store is not None else "")

    # --- ring ----------------------------------------------------------------------------------------------

    def _ring_loop(self) -> None:
        while not self._stop.is_set():
            frames = self.ring.recv(0.1)
            if frames is None:
                self._release_if_abandoned()
                continue
            self._contact = time.monotonic()
            with self._lock:
                try:
                    self._serve_ring(frames)
                except Exception:  # keep the ring thread alive whatever one message does
                    log.exception("ring message failed")
                finally:
                    self._activity = ""

    def _release_if_abandoned(self) -> None:
        """Free the windows when no head has said anything for release_after_s: its head has gone (crashed, or its
        device left the network), and the memory is the device owner's again. The next head sees an idle node, and
        why, and deploys again. Runs on the ring thread, so the control loop never waits for the lock."""
        limit = self.settings.release_after_s
        if limit <= 0 or self._deployment is None or time.monotonic() - self._contact < limit:
            return
        if self._loader is not None and self._loader.is_alive():
            return
        with self._lock:
            dep, silent = self._deployment, time.monotonic() - self._contact
            if dep is None or silent < limit:  # a message or a load came in meanwhile
                return
            self._drop_deployment()
            message = (f"freed the windows of assignment {dep.epoch} after {silent:.0f} s without a word from a head "
                       f"(--release-after {limit:g}); deploy an assignment again to use this node")
            self._status = Status(node=self.name, state="idle", message=message)
            self._kv_positions = 0
        log.warning("%s", message)

    def _serve_ring(self, frames: list[bytes | memoryview]) -> None:
        dep = self._deployment
        epoch, step = (dep.epoch if dep else 0), -1
        try:
            msg, rows = decode_ring(frames)
            step = msg.step
            if dep is None:
                raise ProtocolError("this node has no assignment loaded; send it one first")
            if msg.epoch != dep.epoch:
                raise ProtocolError(f"message of assignment {msg.epoch}, this node runs assignment {dep.epoch}")
            self._owner.heard_holder()  # only the holder's ring carries its assignment
            out: tuple[Activation | KvOp | RingError, np.ndarray | None]
            if isinstance(msg, Activation):
                self._activity = (f"computing step {msg.step} round {msg.round}: {msg.n_rows} row(s) of "
                                  f"{len(msg.parts)} sequence(s)")
                t0 = time.perf_counter()
                out = dep.run(msg, rows, frames[2] if msg.embd_rows else b"")  # type: ignore[arg-type]
                self._busy_s += time.perf_counter() - t0
                self._last_step, self._steps_done = msg.step, self._steps_done + 1
            elif isinstance(msg, KvOp):
                self._activity = f"applying kv {msg.op} (step {msg.step})"
                dep.apply(msg)
                out = (msg, None)
            else:
                out = (msg, None)
            # read here, by the thread that computes: the status thread must not touch llama.cpp's caches
            self._kv_positions = dep.device.kv_pos_max(0) + 1
        except (ProtocolError, PrimaplugError) as e:
            step = e.step if isinstance(e, RingFrameError) else step
            message = _brief(str(e))
            log.warning("ring message refused (step %d): %s", step, message)
            if dep is None:
                return  # no successor to tell: the head will time out and ask for a status
            out = (RingError(proto=PROTOCOL_VERSION, epoch=epoch, step=step, node=self.name, code="bad_message",
                             message=message), None)
        self._activity = f"sending step {out[0].step} to {dep.out.address}"
        # a relay passes the embedding rows on to the node that runs layer 0
        embd = frames[2] if isinstance(out[0], Activation) and out[0].embd_rows else b""
        if not dep.out.send(encode_ring(*out, embd), self.settings.send_timeout_s):
            log.error("successor %s did not take step %d within %.1f s; dropped it", dep.out.address, out[0].step,
                      self.settings.send_timeout_s)
        if isinstance(out[0], Activation):
            dep.sent(out[0])


class _StoppedError(PrimaplugError):
    """A load given up because the node is stopping."""


def _brief(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A refusal's message, cut short: it may quote what a peer sent (a name, a value that failed to decode), and a
    megabyte of it must not go to the log and back over the wire."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _check_assignment(a: Assignment, layout: ModelLayout) -> str:
    """What is wrong with an assignment for this model on this device ("" when nothing): every field is checked
    here, before llama.cpp sees it (it asserts, or wraps sizes into 32 bits, or allocates whatever it is told)."""
    n_layer = layout.n_layer
    if not a.windows:
        return "an assignment needs at least one window (an empty one makes a relay)"
    if len(a.windows) > n_layer:
        return f"{len(a.windows)} rounds: a model of {n_layer} layers goes round the ring at most {n_layer} times"
    prev = -1
    for w in a.windows:
        if not 0 <= w.start <= w.end <= n_layer:
            return f"window [{w.start}, {w.end}) is outside the model's layers [0, {n_layer})"
        if w.start < prev:
            return "windows must come in layer order, one per round"
        if not 0 <= w.gpu_layers <= w.end - w.start:
            return f"window [{w.start}, {w.end}) cannot have {w.gpu_layers} GPU layers"
        prev = w.end if w.end > w.start else prev
    if min(a.n_ctx, a.n_batch, a.n_ubatch, a.n_seq_max) < 1 or a.n_threads < 0:
        return "n_ctx, n_batch, n_ubatch and n_seq_max must be positive, n_threads not negative"
    if max(a.n_ctx, a.n_batch, a.n_ubatch) > MAX_COUNT:
        return f"n_ctx, n_batch and n_ubatch must be at most {MAX_COUNT} (got {a.n_ctx}, {a.n_batch}, {a.n_ubatch})"
    cores = usable_cores()
    if a.n_threads > THREADS_PER_CORE * cores:
        return (f"{a.n_threads} compute threads on a device of {cores} cores: at most {THREADS_PER_CORE * cores} "
                "(0: one per core)")
    if not 0 <= a.n_rs_seq <= a.n_batch:  # a snapshot a token of a batch at most: more could never be used
        return f"{a.n_rs_seq} recurrent-state snapshots a sequence: 0 to a batch's {a.n_batch} tokens"
    if a.n_seq_max > MAX_PARALLEL:
        return f"{a.n_seq_max} sequences: llama.cpp holds at most {MAX_PARALLEL}"
    if a.n_ubatch > a.n_batch or a.n_batch > a.n_ctx:
        return f"batch sizes must satisfy n_ubatch <= n_batch <= n_ctx (got {a.n_ubatch}, {a.n_batch}, {a.n_ctx})"
    if a.n_seq_max > a.n_batch:  # llama.cpp asserts (and the node aborted): it reserves an output row per sequence
        return f"{a.n_seq_max} sequences need batches of at least as many rows (n_batch is {a.n_batch})"
    if a.n_ctx < a.n_seq_max:
        return f"a context of {a.n_ctx} positions leaves none to each of {a.n_seq_max} sequences"
    widest = max(w.end - w.start for w in a.windows)
    if not 0 <= a.stream_room <= widest + 1:  # room for more than a window's layers and one holds nothing more
        return f"a room of {a.stream_room} layers: 0 (the node's own rule) to a window's layers and one ({widest + 1})"
    if any(w.gpu_layers for w in a.windows) and gpu.engine_backend() == "cpu":
        # llama.cpp would run them on the CPU without a word, from copies in anonymous memory that the plan
        # counted as VRAM (docs/gpu.md)
        return no_gpu_backend("this node's engine")
    # the KV cache of a GPU layer lives in VRAM (llama.cpp's offload_kqv): only the CPU layers' count against RAM
    cpu_part = [LayerRange(w.start + w.gpu_layers, w.end) for w in a.windows if w.end > w.start + w.gpu_layers]
    need, total = reserved_bytes(layout, cpu_part, a.n_ctx, a.n_batch, a.n_ubatch), memory_view().total_bytes
    if need > total:  # a huge context once had a node allocate 24 GiB before it could fail
        return (f"a context of {a.n_ctx} positions (batches of {a.n_batch}, {a.n_ubatch} at a time) needs "
                f"{need / 2**30:.1f} GiB of KV cache and compute buffers for these windows' CPU layers; this device "
                f"has {total / 2**30:.1f} GiB in all: ask for a smaller context")
    if len(a.successor) > MAX_ENDPOINT_CHARS or not a.successor.startswith("tcp://"):
        return f"successor '{_brief(a.successor, 80)}' is not a tcp:// endpoint"
    try:
        host, port = parse_endpoint(a.successor)
    except ConfigError:
        host, port = "", 0
    if not host or not 0 < port < 65536:
        return f"successor '{a.successor}' is not a tcp://HOST:PORT endpoint"
    return ""
