"""The type tables a GGUF header is read with (engine/ggml_types.py) are the engine's and gguf's."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from primaplug.engine.ggml_types import GGML_TYPES, GGUFValueType, block, type_name


def test_every_type_is_the_engines_own() -> None:
    from llama_cpp import llama_cpp as ll

    from primaplug.engine import _native

    base = _native._ggml_base
    base.ggml_type_name.restype, base.ggml_type_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    base.ggml_blck_size.restype, base.ggml_blck_size.argtypes = ctypes.c_int64, [ctypes.c_int]
    base.ggml_type_size.restype, base.ggml_type_size.argtypes = ctypes.c_size_t, [ctypes.c_int]
    engine = {base.ggml_type_name(i).decode().upper(): (i, base.ggml_blck_size(i), base.ggml_type_size(i))
              for i in range(ll.GGML_TYPE_COUNT) if base.ggml_blck_size(i) > 0}  # 0: a type ggml removed
    assert engine == GGML_TYPES


def test_names_and_ids_are_ggufs() -> None:
    from gguf import GGMLQuantizationType
    from gguf import GGUFValueType as Theirs

    for t in GGMLQuantizationType:
        assert type_name(int(t)) == t.name
    assert {v.name: int(v) for v in Theirs} == {v.name: int(v) for v in GGUFValueType}
    assert block("Q4_K") == (256, 144)


def test_an_unknown_type_is_named() -> None:
    with pytest.raises(ValueError, match="ggml type 99 is not one this engine knows"):
        type_name(99)


def test_a_node_reads_headers_without_the_gguf_package() -> None:
    """What the table is for: gguf's import (with yaml) takes about 4 MiB of every node's and head's memory."""
    code = ("import sys\nfrom primaplug.engine import bindings_only\nbindings_only()\nimport primaplug.node.daemon\n"
            "import primaplug.cli.run, primaplug.head, primaplug.profiler\nprint(sorted({'gguf', 'yaml'} & "
            "set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
