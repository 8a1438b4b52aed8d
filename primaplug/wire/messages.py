"""Control-channel messages: the head asks, a node answers.

Every request gets exactly one reply: the reply named in its docstring, or an ErrorReply. Fields carry their
units; layer ranges are [start, end). Adding a field with a default keeps PROTOCOL_VERSION (decoders ignore
fields they do not know); removing or changing one bumps it.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Literal, Protocol

import msgspec

from primaplug.core.errors import ProtocolError
from primaplug.core.profiles import DeviceProfile

PROTOCOL_VERSION = 4  # 2: activations carry parts of several sequences; 3: requests name their head (HeadTag);
# 4: token ids bring the embedding rows a fetching first node lacks


class _Msg(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=False):
    pass


class _Layout(Protocol):  # primaplug.engine.ModelLayout fits
    identity: str
    n_layer: int
    n_embd: int


class ModelIdentity(msgspec.Struct, frozen=True):
    """Names one exact GGUF: its size plus a hash of its header and tensor table (ModelLayout.identity)."""

    identity: str
    file_name: str
    n_layer: int
    n_embd: int

    @classmethod
    def of(cls, layout: _Layout, file_name: str) -> ModelIdentity:
        """The identity of the GGUF whose layout this is (file_name: its name, shown in messages)."""
        return cls(identity=layout.identity, file_name=file_name, n_layer=layout.n_layer, n_embd=layout.n_embd)


class FileSource(msgspec.Struct, frozen=True):
    """Where a node that lacks a model's file fetches the parts it runs (primaplug/store): the control endpoints of
    the holders, tried in order, and the digest of the model's manifest (Manifest.digest), which the head computed
    from its own copy. Every piece fetched is checked against the manifest, and the manifest against this digest,
    so a holder that lies is found out."""

    holders: tuple[str, ...]
    manifest_sha256: str
    file_name: str = ""  # the head's name for the file, for people


class DeviceFacts(msgspec.Struct, frozen=True):
    os: str
    machine: str
    cpu_count: int
    mem_total_bytes: int
    mem_available_bytes: int
    # the CPU kernels the node's engine runs (engine.cpu_kernels): a ring of several cannot match plain
    # llama-cpp-python bit for bit; empty from nodes older than the field
    kernels: str = ""
    # a node with a model folder (node --model-dir): what the copies it fetches may take on its disk; 0: it fetches
    # nothing, and needs the whole file (--model)
    disk_budget_bytes: int = 0


class WindowSpec(msgspec.Struct, frozen=True):
    """One window of a node: layers [start, end) in one round, of which gpu_layers run on its GPU."""

    start: int
    end: int
    gpu_layers: int = 0


class Assignment(msgspec.Struct, frozen=True):
    """What a node runs: one window per round (an empty window makes it a relay in that round)."""

    epoch: int  # increases with every assignment the head sends; ring messages of other epochs are refused
    model: ModelIdentity
    windows: tuple[WindowSpec, ...]
    successor: str  # the ring endpoint this node sends its output to
    n_ctx: int  # KV cells of every window: n_seq_max sequences of n_ctx // n_seq_max positions each
    n_batch: int
    n_ubatch: int
    n_threads: int = 0  # 0: every core of the node
    n_seq_max: int = 1  # sequences (requests in flight) each window's cache holds
    # a node that streams goes layer by layer with room for this many layers beside the kept part, as the plan
    # chose from the ring's timing (scheduler/rooms.py); 0: the node's own rule (device/memory.py)
    stream_room: int = 0
    n_rs_seq: int = 0  # recurrent-state snapshots a sequence keeps, to forget a rejected draft (ContextSettings)
    # per-layer inputs (Gemma 4 E2B/E4B): the rows carry those of the layers up to this one, the head keeping those of
    # the layers it runs from there (ContextSettings.row_end); 0: every layer's
    row_end: int = 0

    @property
    def n_ctx_seq(self) -> int:
        """Positions one sequence may hold."""
        return self.n_ctx // max(1, self.n_seq_max)


class ExpertTraffic(msgspec.Struct, frozen=True):
    """What a node streaming a mixture of experts read for its routed experts since its windows loaded
    (memory/experts.py): the experts its layers chose, those already in memory or predicted, and the bytes."""

    tokens: int = 0
    chosen: int = 0  # (layer, expert) choices
    resident: int = 0  # of those, in memory when chosen
    predicted: int = 0  # of those, read ahead because the next layer's choice was predicted
    bytes_chosen: int = 0  # what a reader of exactly the chosen experts reads
    bytes_read: int = 0
    bytes_predicted_unused: int = 0

    def describe(self) -> str:
        mib, t = 2**20, max(1, self.tokens)
        share = (lambda n: n / self.chosen) if self.chosen else (lambda n: 0.0)
        return (f"experts {self.bytes_read / t / mib:.1f} MiB read a token for {self.bytes_chosen / t / mib:.1f} "
                f"MiB chosen, {share(self.resident):.0%} of the chosen resident, {share(self.predicted):.0%} "
                f"predicted")


MAX_HEAD_ID, MAX_HEAD_TEXT = 64, 1024  # a head's id is 16 hex digits (head/identity.py); its name and address short


class HeadTag(msgspec.Struct, frozen=True):
    """The head that sends a request. A node belongs to one head at a time (node/owner.py): the head whose
    requests it last accepted, for as long as that head keeps speaking (HEAD_LEASE_S)."""

    id: str  # random, made when the head starts: the same across its reconnects and re-formings
    name: str  # what it is, for people: "primaplug serve (pid 4242) on desk"
    address: str = ""  # where it receives the ring's output ("" before it listens)
    started: float = 0.0  # Unix time the head started
    served: int = 0  # requests it has completed

    def __post_init__(self) -> None:  # checked as it is decoded: a node keeps the head that holds it, and shows it
        if not 0 < len(self.id) <= MAX_HEAD_ID or max(len(self.name), len(self.address)) > MAX_HEAD_TEXT:
            raise ValueError(f"a head's id is 1 to {MAX_HEAD_ID} characters, its name and address at most "
                             f"{MAX_HEAD_TEXT}")


class Holder(msgspec.Struct, frozen=True):
    """The head a node belongs to now, as the node sees it."""

    head: HeadTag
    since: float  # Unix time the node became this head's
    silent_s: float  # seconds since this head last said anything to the node
    lease_s: float  # silence after which the node is free again

    def describe(self) -> str:
        """The holder in a sentence: which head, where, since when, what it did, when it last spoke."""
        head = self.head
        at = f", ring at {head.address}" if head.address else ""
        since = datetime.fromtimestamp(self.since).strftime("%Y-%m-%d %H:%M:%S")
        return (f"head {head.id[:8]} ({head.name}{at}) since {since}, which has served {head.served} request(s) and "
                f"last spoke {self.silent_s:.1f} s ago")


# --- requests -------------------------------------------------------------------------------------------------
# The requests that change what a node does (load, unload, profile, shut down) name their head and are refused,
# with the holder named, while another head holds the node; take_over takes it anyway. A status request names its
# head too: it is how a holder that runs no request keeps the node.

class Hello(_Msg, tag="hello"):
    """Opens a session with a node. Reply: Welcome."""

    proto: int
    software: str


class LoadAssignment(_Msg, tag="load"):
    """Replaces the node's assignment; loading goes on in the background. Reply: Status (state "loading")."""

    assignment: Assignment
    head: HeadTag | None = None
    take_over: bool = False
    source: FileSource | None = None  # for a node without the model's file: where to fetch its windows' bytes


class GetStatus(_Msg, tag="status"):
    """Reply: Status. With detail, also the memory measurements (they cost a mincore over the windows)."""

    detail: bool = False
    head: HeadTag | None = None


class GetProfile(_Msg, tag="profile"):
    """Asks for the node's DeviceProfile for one of its models (compute is timed for that model's quantization
    types). Measuring runs in the background (seconds; cached on the device afterwards): until it is done the
    reply carries no profile and says what is being measured, and the head asks again. Reply: ProfileReply."""

    model: str  # ModelIdentity.identity
    force: bool = False  # measure again even when the device has a cached profile
    head: HeadTag | None = None
    take_over: bool = False
    source: FileSource | None = None  # for a node without the model's file: where to fetch its header


class Unload(_Msg, tag="unload"):
    """Frees the node's windows; it keeps serving. With release, the head also lets the node go (it closes): any head
    may deploy there at once. Reply: Status (state "idle")."""

    head: HeadTag | None = None
    take_over: bool = False
    release: bool = False


class Shutdown(_Msg, tag="shutdown"):
    """Stops the node process. Reply: Status, then the node exits."""

    head: HeadTag | None = None
    take_over: bool = False


class GetManifest(_Msg, tag="get_manifest"):
    """Asks a holder (a head, or a node with a copy) for the manifest of a model it was given, by identity, never by
    path. Reply: Manifest."""

    model: str  # ModelIdentity.identity


class ReadPiece(_Msg, tag="read_piece"):
    """Asks a holder for one piece of a model's file (Manifest's numbering). Reply: PieceData, or an ErrorReply
    ("missing") from a holder whose copy lacks it."""

    model: str
    index: int


ControlRequest = Hello | LoadAssignment | GetStatus | GetProfile | Unload | Shutdown | GetManifest | ReadPiece


# --- replies --------------------------------------------------------------------------------------------------

class HeldCopy(msgspec.Struct, frozen=True):
    """A model a node holds in part, in its model folder: the units (engine/layout.py: "blk.N", "input", ...) whose
    every piece it holds."""

    model: str  # ModelIdentity.identity
    units: tuple[str, ...]


class Welcome(_Msg, tag="welcome"):
    proto: int
    software: str
    node: str
    models: tuple[ModelIdentity, ...]
    device: DeviceFacts
    ring_endpoint: str  # where this node receives ring messages
    copies: tuple[HeldCopy, ...] = ()  # models it holds in part (fetched into its model folder)


NodeState = Literal["idle", "loading", "ready", "failed"]


class Status(_Msg, tag="status_reply"):
    node: str
    state: NodeState
    epoch: int = 0
    progress: float = 0.0  # of the current load, 0..1
    message: str = ""  # what is being loaded, or why the load failed
    activity: str = ""  # what the ring thread is doing right now, "" when waiting
    last_step: int = -1  # the last ring step this node finished
    steps_done: int = 0
    busy_s: float = 0.0  # seconds the ring thread has spent running windows since the node started
    kv_positions: int = 0  # positions of sequence 0 its caches held after its last ring message
    # memory (filled in when asked with detail)
    memory_mode: str = ""  # "resident (no windowing)" or how windows are prefetched
    bytes_prefetched: int = 0
    bytes_released: int = 0
    major_faults_per_token: float = 0.0  # during compute, the prefetcher's own faults left out
    resident_bytes: int = 0  # of the node's windows, by mincore
    memory_pressure: float = 0.0  # drop in available memory since the node started, over total (cgroup) memory
    memory_budget_bytes: int = 0  # what the node's windows' weights may use (computed at load, or --memory-budget)
    experts: ExpertTraffic | None = None  # a mixture of experts whose routed experts it reads as chosen
    holder: Holder | None = None  # the head the node belongs to; None: free (none, or its lease lapsed)
    fetched_bytes: int = 0  # of model pieces this node fetched into its model folder since it started
    fetch_s: float = 0.0  # seconds its last fetch of windows' pieces took
    disk_bytes: int = 0  # what the model folder's copies take on disk (their holes take nothing)
    disk_budget_bytes: int = 0  # what they may take (--disk-budget); 0: the node keeps no folder


class ProfileReply(_Msg, tag="profile_reply"):
    node: str
    profile: DeviceProfile | None = None  # None while it is being measured
    message: str = ""  # what is being measured


class ErrorReply(_Msg, tag="error"):
    node: str
    # bad_message, wrong_model, bad_assignment, not_ready, protocol_version, held, internal, missing (a piece)
    code: str
    message: str
    retryable: bool = False
    holder: Holder | None = None  # with code "held": the head that holds the node


class Manifest(_Msg, tag="manifest"):
    """A model file cut into pieces: the header's bytes and every tensor's, at most piece_bytes each (the padding
    between tensors is in none), with the SHA-256 of each as the holder read it (store/manifest.py)."""

    model: str  # ModelIdentity.identity
    file_size: int
    piece_bytes: int
    header_bytes: int  # the header's (the first pieces'): what a node reads the rest of the cut from
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    sha256: bytes  # 32 bytes a piece, in order

    def digest(self) -> str:
        """What FileSource.manifest_sha256 names: the hash of the manifest's encoding."""
        return hashlib.sha256(encode(self)).hexdigest()

    def piece_sha256(self, index: int) -> bytes:
        return self.sha256[32 * index:32 * index + 32]


class PieceData(_Msg, tag="piece"):
    model: str
    index: int
    data: bytes


ControlReply = Welcome | Status | ProfileReply | ErrorReply | Manifest | PieceData

_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(ControlRequest)
_rep_dec = msgspec.msgpack.Decoder(ControlReply)


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


# what msgspec raises for bytes that are not a message: a string that is not UTF-8 is a UnicodeDecodeError (it once
# escaped the node's control loop and stopped the node)
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)


def decode_request(data: bytes) -> ControlRequest:
    try:
        return _req_dec.decode(data)
    except DECODE_ERRORS as e:
        raise ProtocolError(f"malformed control request: {e}") from None


def decode_reply(data: bytes) -> ControlReply:
    try:
        return _rep_dec.decode(data)
    except DECODE_ERRORS as e:
        raise ProtocolError(f"malformed control reply: {e}") from None
