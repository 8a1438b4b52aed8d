"""Pure values and rules shared by every part of primaplug: errors, layer windows and the memory budget's
constants (budget.py). No I/O."""

from primaplug.core.errors import (
    ConfigError,
    EngineError,
    ModelFormatError,
    NodeError,
    NodeHeldError,
    NodeUnavailableError,
    PlacementInfeasibleError,
    PrimaplugError,
    ProtocolError,
    RecurrentRewindError,
    UnsupportedArchitectureError,
    WindowRangeError,
)
from primaplug.core.windows import LayerRange, check_cover, even_split, execution_order, ring_windows

__all__ = [
    "ConfigError",
    "EngineError",
    "NodeError",
    "NodeHeldError",
    "NodeUnavailableError",
    "PlacementInfeasibleError",
    "ProtocolError",
    "RecurrentRewindError",
    "LayerRange",
    "ModelFormatError",
    "PrimaplugError",
    "UnsupportedArchitectureError",
    "WindowRangeError",
    "check_cover",
    "even_split",
    "execution_order",
    "ring_windows",
]
