"""The errors primaplug raises. Each message says what went wrong and what to do about it."""

from __future__ import annotations


class PrimaplugError(Exception):
    """Root of every error primaplug raises on purpose."""


class ModelFormatError(PrimaplugError):
    """A file is not a GGUF model primaplug can read."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class UnsupportedArchitectureError(PrimaplugError):
    """The model's architecture has no layer-window support in the patched engine."""

    def __init__(self, arch: str, supported: tuple[str, ...], reason: str | None = None) -> None:
        self.arch = arch
        self.supported = supported
        self.reason = reason
        if reason and arch in supported:
            text = f"this '{arch}' model cannot run in layer windows: {reason}"
        else:  # an architecture windows do not cover: why, where known, and what they cover
            text = (f"architecture '{arch}' cannot run in layer windows{': ' + reason if reason else ''}; supported "
                    f"architectures: {', '.join(supported)}")
        super().__init__(text)


class RecurrentRewindError(PrimaplugError):
    """A conversation on a model with recurrent layers was asked to forget some positions, not all."""

    def __init__(self, pos: int, held: int) -> None:
        super().__init__(
            f"cannot rewind to position {pos} of {held}: this model's recurrent layers (gated delta-net) keep one "
            "state that cannot forget positions. Clear the conversation and evaluate it again (llama-cpp-python does "
            "so when kv_cache_seq_rm returns False), and run without a draft model (--draft)")


class WindowRangeError(PrimaplugError):
    """A layer window does not fit the model, or does not fit what was loaded."""


class EngineError(PrimaplugError):
    """The native engine failed (a llama.cpp call returned an error code or NULL)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = code
        super().__init__(message if code is None else f"{message} (code {code})")


class ProtocolError(PrimaplugError):
    """A message on the wire is malformed, of another protocol version, or does not fit its receiver."""


class NodeError(PrimaplugError):
    """A node refused a request or reported a failure. `node` names it, `code` says what kind."""

    def __init__(self, node: str, code: str, message: str) -> None:
        self.node = node
        self.code = code
        super().__init__(f"node {node}: {message}")


class NodeHeldError(NodeError):
    """A node belongs to another head, which deployed there and still speaks to it. `holder` is that head as the node
    described it (wire.Holder)."""

    def __init__(self, node: str, message: str, holder: object) -> None:
        self.holder = holder
        super().__init__(node, "held", message)


class NodeUnavailableError(PrimaplugError):
    """A node stopped answering: it died, hung, or its network went away."""

    def __init__(self, node: str, message: str) -> None:
        self.node = node
        super().__init__(message)


class ConfigError(PrimaplugError):
    """The settings given cannot work (a missing key file, an address that needs keys, ...)."""


class PlacementInfeasibleError(PrimaplugError):
    """No plan places the model on the devices: it does not fit even with disk offload, or no window size works.

    `shortfall_bytes` is how much more memory (RAM or VRAM, without spilling to a slow disk) the devices would
    need, 0 when memory is not what is short; `reason` says what is short in words.
    """

    def __init__(self, reason: str, *, shortfall_bytes: int = 0, advice: str = "") -> None:
        self.reason = reason
        self.shortfall_bytes = shortfall_bytes
        self.advice = advice
        super().__init__(f"cannot place the model: {reason}" + (f"; {advice}" if advice else ""))


def no_gpu_backend(who: str, backends: str = "", without: str = "plan") -> str:
    """What to say when GPU layers are asked of an engine built without a GPU backend: `who` ("this node's engine",
    "node2's engine"), the backends llama.cpp registered there where they are known, and how to go on without GPU
    layers ("plan" them away, or "run" without)."""
    found = f"; llama.cpp's backends here: {backends}" if backends else ""
    return (f"{who} has no GPU backend (built for cpu{found}): rebuild it with `--gpu cuda` (scripts/build_engine.py, "
            f"or `make engine GPU=cuda`; `--gpu metal` on a Mac), or {without} without GPU layers (-ngl 0)")


class SchemaError(PrimaplugError, ValueError):
    """A `json_schema` response format that is malformed or that no grammar can express (the server: a 400)."""
