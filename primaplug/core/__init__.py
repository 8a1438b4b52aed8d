"""Pure values and rules shared by every part of primaplug: errors and layer windows. No I/O."""

from primaplug.core.errors import (
    EngineError,
    ModelFormatError,
    PrimaplugError,
    UnsupportedArchitectureError,
    WindowRangeError,
)
from primaplug.core.windows import LayerRange, check_cover, even_split, execution_order, ring_windows

__all__ = [
    "EngineError",
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
