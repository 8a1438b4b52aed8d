"""ggml's tensor types as GGUF files store them (id, values per block, bytes per block), and GGUF's metadata value
types: what reading a GGUF header needs.

The `gguf` package has these tables too, but importing it (it pulls in yaml and modules of its own) takes about
4 MiB of a process's memory, and every node and head reads GGUF headers: on a phone that is memory taken from the
apps people use (docs/peers.md, "Memory pressure"). They are written here once; tests/test_ggml_types.py checks them
against the engine's own type traits (libggml, which reads the weights) and against gguf's names.
"""

from __future__ import annotations

from enum import IntEnum

# name: (ggml type id, values per block, bytes per block), as ggml.c's type_traits; ids 4, 5, 31-33 and 36-38 are
# types ggml removed
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 36), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "Q8_K": (15, 256, 292),
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50),
    "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136),
    "I8": (24, 1, 1), "I16": (25, 1, 2), "I32": (26, 1, 4), "I64": (27, 1, 8), "F64": (28, 1, 8),
    "IQ1_M": (29, 256, 56), "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66),
    "MXFP4": (39, 32, 17), "NVFP4": (40, 64, 36), "Q1_0": (41, 128, 18), "Q2_0": (42, 64, 18),
}
_NAMES = {type_id: name for name, (type_id, _, _) in GGML_TYPES.items()}


def type_name(type_id: int) -> str:
    """The name of a ggml type id, as GGUF tools print it (Q4_K); ValueError for an id this engine does not know."""
    try:
        return _NAMES[type_id]
    except KeyError:
        raise ValueError(f"ggml type {type_id} is not one this engine knows (a newer llama.cpp's, or a damaged "
                         "file)") from None


def type_id(name: str) -> int:
    return GGML_TYPES[name][0]


def block(name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a type, by name; KeyError for a name ggml does not know."""
    return GGML_TYPES[name][1:]


class GGUFValueType(IntEnum):
    """The types of a GGUF header's metadata values (gguf.h's gguf_type)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12
