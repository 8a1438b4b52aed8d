"""Typed, versioned messages between the head and the nodes: the only thing `node` and `head` share.

Control messages (`messages.py`) are msgpack-encoded tagged structs, one request and one reply each.
Ring messages (`ring.py`) are a msgpack header plus, for activations, one raw buffer frame sent without copy.
"""

from primaplug.wire.messages import (
    PROTOCOL_VERSION,
    Assignment,
    ControlReply,
    ControlRequest,
    DeviceFacts,
    ErrorReply,
    ExpertTraffic,
    FileSource,
    GetManifest,
    GetProfile,
    GetStatus,
    HeadTag,
    HeldCopy,
    Hello,
    Holder,
    LoadAssignment,
    Manifest,
    ModelIdentity,
    PieceData,
    ProfileReply,
    ReadPiece,
    Shutdown,
    Status,
    Unload,
    Welcome,
    WindowSpec,
    decode_reply,
    decode_request,
    encode,
)
from primaplug.wire.ring import (
    Activation,
    KvOp,
    Part,
    RingError,
    RingFrameError,
    RingMessage,
    decode_ring,
    encode_ring,
    window_output,
)

__all__ = [
    "PROTOCOL_VERSION", "Activation", "Assignment", "ControlReply", "ControlRequest", "DeviceFacts", "ErrorReply",
    "ExpertTraffic", "FileSource", "GetManifest", "GetProfile", "GetStatus", "HeadTag", "HeldCopy", "Hello",
    "Holder", "KvOp", "LoadAssignment", "Manifest", "ModelIdentity", "Part", "PieceData", "ProfileReply", "ReadPiece",
    "RingError", "RingFrameError", "RingMessage", "Shutdown", "Status", "Unload", "Welcome", "WindowSpec",
    "decode_reply", "decode_request", "decode_ring", "encode", "encode_ring", "window_output",
]
