"""`primaplug layout`: a GGUF model's layers, their bytes and KV bytes per token, read from its header."""

from __future__ import annotations

import argparse
from typing import Any

from primaplug.cli.common import model_path


def add_parser(sub: Any) -> None:
    lay = sub.add_parser("layout", help="print a GGUF model's layers, sizes and KV bytes")
    lay.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    lay.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from primaplug.engine import read_layout

    layout = read_layout(model_path(args))
    mib = 1 << 20
    print(f"{layout.path}\n  arch {layout.arch}, {layout.n_layer} layers, n_embd {layout.n_embd}, "
          f"vocab {layout.n_vocab}, windows {'supported' if layout.supports_windows else 'NOT supported'}")
    print(f"  input {layout.input_bytes / mib:.1f} MiB, output {layout.output_bytes / mib:.1f} MiB"
          f"{' (tied to the input embedding)' if layout.output_tied else ''}")
    for il in range(layout.n_layer):
        print(f"  layer {il:3d}: {layout.layer_bytes(il) / mib:7.2f} MiB, KV {layout.kv_bytes_per_token(il)} B/token"
              f"{' (sliding window)' if layout.swa_layers[il] else ''}")
    return 0
